// fauxqs on loopback only (its own command line listens on every address):
//   node fauxqs-loopback.mjs PORT
import { buildApp } from "./node_modules/fauxqs/dist/app.js";
import { SqsStore } from "./node_modules/fauxqs/dist/sqs/sqsStore.js";
import { SnsStore } from "./node_modules/fauxqs/dist/sns/snsStore.js";
import { S3Store } from "./node_modules/fauxqs/dist/s3/s3Store.js";

const port = parseInt(process.argv[2] || "9810", 10);
const app = buildApp({
  logger: false,
  host: "127.0.0.1",
  defaultRegion: "us-east-1",
  stores: { sqsStore: new SqsStore(), snsStore: new SnsStore(), s3Store: new S3Store() },
});
await app.listen({ port, host: "127.0.0.1" });
for (const sig of ["SIGTERM", "SIGINT"]) process.on(sig, () => app.close().then(() => process.exit(0)));
