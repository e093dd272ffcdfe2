// A producer as a user's application writes one, with the AWS SDK for
// JavaScript: the SQS tests create their queues and send their messages
// through it. Credentials and region from the AWS environment variables.
//   node produce.mjs create ENDPOINT NAME         -> prints the queue URL
//   node produce.mjs send ENDPOINT URL BODY [GROUP DEDUP] -> prints the message id
//   node produce.mjs lines ENDPOINT URL < FILE  -> one send per line "GROUP<TAB>BODY"
//        (GROUP empty on a standard queue; a FIFO send gets a fresh dedup id),
//        in order; prints how many were sent
//   node produce.mjs attrs ENDPOINT URL BODY NAME=VALUE... -> a send with String attributes
import { SQSClient, CreateQueueCommand, SendMessageCommand } from "@aws-sdk/client-sqs";
import { randomUUID } from "node:crypto";
import { readFileSync } from "node:fs";

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
} else if (cmd === "lines") {
  let n = 0;
  for (const line of readFileSync(0, "utf8").split("\n")) {
    if (!line) continue;
    const tab = line.indexOf("\t");
    const g = line.slice(0, tab), body = line.slice(tab + 1);
    const p = { QueueUrl: a, MessageBody: body };
    if (g) {
      p.MessageGroupId = g;
      p.MessageDeduplicationId = randomUUID();
    }
    await sqs.send(new SendMessageCommand(p));
    n++;
  }
  console.log(n);
} else if (cmd === "attrs") {
  const MessageAttributes = {};
  for (const kv of process.argv.slice(6)) {
    const i = kv.indexOf("=");
    MessageAttributes[kv.slice(0, i)] = { DataType: "String", StringValue: kv.slice(i + 1) };
  }
  const r = await sqs.send(new SendMessageCommand({ QueueUrl: a, MessageBody: b, MessageAttributes }));
  console.log(r.MessageId);
} else {
  console.error("usage: produce.mjs create|send ...");
  process.exit(2);
}
