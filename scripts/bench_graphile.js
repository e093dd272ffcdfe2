// scripts/bench_graphile.js: Graphile Worker running the bench's durable
// effect for scripts/bench-pgq, in the configuration of its performance page
// (24 concurrent jobs, a pool of 25, a local queue of 500, completions and
// failures batched with no delay). Task `pay`: in one transaction, claim the
// business key (INSERT ... ON CONFLICT DO NOTHING into pgqb.gw_keys) and,
// when claimed, insert the effect row (pgqb.effects), as idemq's effect
// does after its own claim. Environment: GW_DSN. Runs until SIGTERM.
"use strict";
const { run } = require("graphile-worker");

const pay = async (payload, helpers) => {
  await helpers.withPgClient(async (c) => {
    await c.query("BEGIN");
    try {
      const r = await c.query(
        "INSERT INTO pgqb.gw_keys (key) VALUES ($1) ON CONFLICT DO NOTHING",
        [payload.job_id],
      );
      if (r.rowCount === 1)
        await c.query(
          "INSERT INTO pgqb.effects (key, amount_minor, t_enq) VALUES ($1, $2, $3)",
          [payload.job_id, payload.amount_minor, payload.t ?? null],
        );
      await c.query("COMMIT");
    } catch (e) {
      await c.query("ROLLBACK");
      throw e;
    }
  });
};

async function main() {
  const runner = await run({
    preset: {
      worker: {
        connectionString: process.env.GW_DSN,
        concurrentJobs: 24,
        maxPoolSize: 25,
        localQueue: { size: 500 },
        completeJobBatchDelay: 0,
        failJobBatchDelay: 0,
      },
    },
    taskList: { pay },
  });
  await runner.promise;
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
