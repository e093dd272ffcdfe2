#!/usr/bin/python3
"""scripts/demo with DEMO_INPUT=celery: a Celery 5.2 application's producer
(Debian's python3-celery) sends shop.charge tasks to idemq and waits on
their results with the rpc:// backend: N charges, every 10th sent a second
time (same order, a new task id), one pickle task, one unknown task name and
one charge without an amount. Prints what each client got.

Usage: demo_celery.py AMQP_URL RUN N
"""
import collections
import sys

import celery

url, run, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
app = celery.Celery("shop", broker=url, backend="rpc://")
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
with app.connection_for_write() as conn:
    conn.ensure_connection(max_retries=3)
    version = conn.connection.server_properties.get("version", b"")
    version = version.decode() if isinstance(version, bytes) else version
if version.split(".")[0].isdigit() and int(version.split(".")[0]) >= 4:
    # Celery 5.2's transient reply queue is refused by RabbitMQ 4 (adapters/README.md)
    type(app.backend).binding = property(
        lambda self: self.Queue(self.oid, self.exchange, self.oid, durable=True,
                                auto_delete=True, expires=self.expires))


def send(name, kwargs, **options):
    return app.send_task(name, kwargs=kwargs, exchange="shop", routing_key="shop",
                         declare=[], **options)


sent = []
for i in range(n):
    order = {"order_id": f"{run}-o{i:04d}", "amount_minor": 100 + i}
    sent.append(("charge", send("shop.charge", order)))
    if i % 10 == 3:
        sent.append(("resent charge", send("shop.charge", order)))
sent.append(("pickle", send("shop.charge", {"order_id": f"{run}-pickle", "amount_minor": 1},
                            serializer="pickle")))
sent.append(("unknown task", send("shop.refund", {"order_id": f"{run}-refund"})))
sent.append(("no amount", send("shop.charge", {"order_id": f"{run}-noamount"})))

got = collections.Counter()
first = {}
for what, res in sent:
    try:
        value = res.get(timeout=60)
        got[f"{what}: SUCCESS"] += 1
        order = value["order_id"]
        if order in first and first[order] != value:
            got["a re-sent charge answered with ANOTHER result"] += 1
        first.setdefault(order, value)
    except Exception as exc:
        got[f"{what}: {res.state} {type(exc).__name__}"] += 1
        if what != "charge" and what != "resent charge":
            print(f"  {what}: {type(exc).__name__}: {exc}")
for line, count in sorted(got.items()):
    print(f"  {count:5d}  {line}")
