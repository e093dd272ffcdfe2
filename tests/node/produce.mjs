// A producer as a user's application writes one, with the AWS SDK for
// JavaScript: the SQS tests create their queues and send their messages
// through it. Credentials and region from the AWS environment variables.
//   node produce.mjs create ENDPOINT NAME         -> prints the queue URL
//   node produce.mjs send ENDPOINT URL BODY [GROUP DEDUP] -> prints the message id
import { SQSClient, CreateQueueCommand, SendMessageCommand } from "@aws-sdk/client-sqs";

const [cmd, endpoint, a, b, group, dedup] = process.argv.slice(2);
const sqs = new SQSClient({ endpoint, region: process.env.AWS_REGION || "us-east-1" });
if (cmd === "create") {
  const Attributes = a.endsWith(".fifo") ? { FifoQueue: "true" } : {};
  const r = await sqs.send(new CreateQueueCommand({ QueueName: a, Attributes }));
  console.log(r.QueueUrl);
} else if (cmd === "send") {
  const p = { QueueUrl: a, MessageBody: b };
  if (group) {
    p.MessageGroupId = group;
    p.MessageDeduplicationId = dedup;
  }
  const r = await sqs.send(new SendMessageCommand(p));
  console.log(r.MessageId);
} else {
  console.error("usage: produce.mjs create|send ...");
  process.exit(2);
}
