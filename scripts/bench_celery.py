#!/usr/bin/python3
"""scripts/bench-celery's Python side, Debian's Celery 5.2.

  bench_celery.py publish URL N RUN TARGET [once]   send N shop.charge tasks
      (10 % of them a second time under a new task id, unless once) to
      TARGET: "idemq" (the
      idemq input's exchange "shop", declare=[]) or "celery" (queue
      bench_celery, which Celery's worker consumes)
  celery -A bench_celery -b URL worker -Q bench_celery (BENCH_PG_DSN set):
      the same effect run by Celery's own worker with acks_late:
      SELECT idemq_demo.shop_charge(...) in its own transaction
      (BENCH_EFFECT=counted: idemq_demo.shop_charge_counted, the kill phase's)
"""
import sys

import celery

app = celery.Celery("bench", backend="rpc://")  # the worker gets its broker from -b
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                task_acks_late=True, worker_prefetch_multiplier=100,
                broker_connection_retry_on_startup=True)


def rpc_binding_for_rabbitmq4():
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=3)
        v = conn.connection.server_properties.get("version", b"")
        v = v.decode() if isinstance(v, bytes) else v
    if v.split(".")[0].isdigit() and int(v.split(".")[0]) >= 4:
        type(app.backend).binding = property(
            lambda self: self.Queue(self.oid, self.exchange, self.oid, durable=True,
                                    auto_delete=True, expires=self.expires))


_db = None


@app.task(name="shop.charge", bind=True)
def charge(self, order_id, amount_minor):
    """Celery's worker: the same effect function, one transaction per task."""
    global _db
    import json
    import os
    import psycopg2
    if _db is None:
        _db = psycopg2.connect(os.environ["BENCH_PG_DSN"])
    payload = {"args": [], "kwargs": {"order_id": order_id, "amount_minor": amount_minor}}
    meta = {"celery": {"task": "shop.charge", "id": self.request.id}}
    # BENCH_EFFECT=counted (the kill phase): the wrapper that also counts
    # each run, and each run for an order already charged (committed)
    fn = ("idemq_demo.shop_charge_counted" if os.environ.get("BENCH_EFFECT") == "counted"
          else "idemq_demo.shop_charge")
    with _db, _db.cursor() as cur:
        try:
            cur.execute(f"SELECT {fn}(%s, %s::jsonb, %s::jsonb)",
                        (order_id, json.dumps(payload), json.dumps(meta)))
            return cur.fetchone()[0]
        except psycopg2.errors.UniqueViolation:
            return {"order_id": order_id, "duplicate": True}


if __name__ == "__main__" and sys.argv[1] == "publish":
    url, n, run, target = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    once = len(sys.argv) > 6 and sys.argv[6] == "once"  # no re-sent orders
    app.conf.broker_url = url
    rpc_binding_for_rabbitmq4()
    opts = ({"exchange": "shop", "routing_key": "shop", "declare": []} if target == "idemq"
            else {"queue": "bench_celery"})
    with app.producer_or_acquire() as producer:
        for i in range(n):
            kw = {"order_id": f"{run}-o{i:06d}", "amount_minor": 100 + i % 1000}
            app.send_task("shop.charge", kwargs=kw, producer=producer, **opts)
            if i % 10 == 3 and not once:
                app.send_task("shop.charge", kwargs=kw, producer=producer, **opts)
