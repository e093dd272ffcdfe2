#!/usr/bin/python3
"""A real Celery producer against idemq (check_celery).

Sends tasks the way an application does (send_task, apply_async through a
Celery app with the rpc:// result backend) to the exchange of an idemq
Celery input and waits on AsyncResult.get(). Exits 0 when every client got
what the contract promises, 1 (with the reasons on stderr) otherwise; the
last stdout line is a JSON summary that check_celery also reads.

Usage: celery_producer.py AMQP_URL EXCHANGE ROUTING_KEY PREFIX [one|expiring|observe|status|delayed]
Needs Debian's python3-celery (5.2) under /usr/bin/python3.
"""
import datetime
import json
import sys
import time
import uuid

import celery
import kombu
from celery.exceptions import TaskRevokedError

url, exchange, rk, prefix = sys.argv[1:5]
app = celery.Celery("producer", broker=url, backend="rpc://")
app.conf.update(task_serializer="json", result_serializer="json",
                accept_content=["json"], result_accept_content=["json"],
                broker_connection_retry_on_startup=True)
failures = []
summary = {"celery": celery.__version__, "kombu": kombu.__version__}

# Celery 5.2's rpc:// reply queue is transient and not exclusive, which
# RabbitMQ 4.0 refuses by default (deprecated feature
# transient_nonexcl_queues). That is between Celery and the broker, not
# idemq: on a 4.x broker the client's reply queue is made durable (still
# auto-delete), everything else as Celery does it.
with app.connection_for_write() as conn:
    conn.ensure_connection(max_retries=3)
    broker_version = conn.connection.server_properties.get("version", "")
    if isinstance(broker_version, bytes):
        broker_version = broker_version.decode()
summary["rabbitmq"] = broker_version
if broker_version.split(".")[0].isdigit() and int(broker_version.split(".")[0]) >= 4:
    type(app.backend).binding = property(
        lambda self: self.Queue(self.oid, self.exchange, self.oid, durable=True,
                                auto_delete=True, expires=self.expires))
    summary["reply_queue"] = "durable (RabbitMQ 4 refuses Celery 5.2's transient one)"
TIMEOUT = 20


def check(what, ok, detail=""):
    if not ok:
        failures.append(f"{what}: {detail}")


def send(name, *, kwargs=None, args=(), **options):
    # declare=[]: the queue is idemq's (declared with its own arguments)
    return app.send_task(name, args=list(args), kwargs=kwargs or {}, exchange=exchange,
                         routing_key=rk, declare=[], **options)


def failure_of(res):
    try:
        value = res.get(timeout=TIMEOUT)
    except Exception as exc:  # the rebuilt exception is the point
        return type(exc).__name__, str(exc), res.state
    return None, repr(value), res.state


mode = sys.argv[5] if len(sys.argv) > 5 else ""

if mode == "expiring":
    # check_celery's expires case: a task with a short expires, committed
    # and then idemq killed before its ack; its redelivery comes after the
    # expiry and must be answered with the stored result, not REVOKED
    # built as send_task does, without the AMQP expiration it would add (the
    # broker would drop the requeued copy: the redelivery is the point here)
    tid = str(uuid.uuid4())
    soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=3)
    msg = app.amqp.create_task_message(tid, "shop.charge", [], {"order_id": f"{prefix}-X",
                                                                "amount": 6}, expires=soon)
    with app.producer_or_acquire() as producer:
        app.backend.on_task_call(producer, tid)
        app.amqp.send_task_message(producer, "shop.charge", msg, exchange=exchange,
                                   routing_key=rk, declare=[], reply_to=app.backend.oid,
                                   serializer="json")
    res = app.AsyncResult(tid)
    try:
        value = res.get(timeout=60)
        check("answered with the result after its expires", value.get("charged") == 6, value)
    except Exception as exc:
        check("answered with the result after its expires", False,
              (type(exc).__name__, str(exc), res.state))
    print(json.dumps({"failures": failures}))
    sys.exit(1 if failures else 0)

if mode == "delayed":
    # check_celery's native delayed delivery case (Celery >= 5.5): the
    # producer knows the task queue as a quorum queue behind a topic
    # exchange, so a countdown goes through celery_delayed_27 .. 0 and
    # celery_delayed_delivery, whose binding back to the queue idemq
    # declared in place of Celery's worker
    from kombu import Exchange, Queue
    app.conf.task_queues = [Queue(rk, Exchange(exchange, type="topic"), routing_key=rk,
                                  queue_arguments={"x-queue-type": "quorum"})]
    summary = {"celery": celery.__version__, "kombu": kombu.__version__}
    t0 = time.monotonic()
    res = app.send_task("shop.charge", kwargs={"order_id": f"{prefix}-N", "amount": 2},
                        countdown=2, queue=rk)
    value = res.get(timeout=40)
    waited = time.monotonic() - t0
    check("applied after its countdown", value.get("charged") == 2 and waited >= 1.5,
          f"{value} after {waited:.2f} s")
    summary["countdown_s"] = round(waited, 2)
    summary["failures"] = failures
    print(json.dumps(summary))
    sys.exit(1 if failures else 0)

if mode == "observe":
    # check_celery's observe case: an observe-mode input never answers, a
    # claimed task or an unroutable one alike (the real worker does)
    from celery.exceptions import TimeoutError as CeleryTimeout
    for name, key in (("shop.charge", f"{prefix}-O1"), ("shop.unknown", f"{prefix}-O2")):
        res = send(name, kwargs={"order_id": key, "amount": 1})
        try:
            value = res.get(timeout=4)
            check(f"{name} not answered in observe mode", False, repr(value))
        except CeleryTimeout:
            pass
        except Exception as exc:
            check(f"{name} not answered in observe mode", False, (type(exc).__name__, str(exc)))
    print(json.dumps({"failures": failures}))
    sys.exit(1 if failures else 0)

if mode == "status":
    # check_celery's celery_duplicate_reply = "status" case: the first
    # sender gets the result or the park's reason; a duplicate (a new task
    # id for the same key) gets only the status
    r1 = send("shop.charge", kwargs={"order_id": f"{prefix}-S", "amount": 8}).get(timeout=TIMEOUT)
    check("first gets the result", r1.get("charged") == 8, r1)
    r2 = send("shop.charge", kwargs={"order_id": f"{prefix}-S", "amount": 8}).get(timeout=TIMEOUT)
    check("a duplicate gets no result", r2 is None, r2)
    name, text, state = failure_of(send("shop.refuse", kwargs={"order_id": f"{prefix}-SR",
                                                               "amount": 1}))
    check("first refusal names its reason", "card declined" in text, (name, text))
    name, text, state = failure_of(send("shop.refuse", kwargs={"order_id": f"{prefix}-SR",
                                                               "amount": 1}))
    check("a duplicate refusal names only its code", name == "IdemqParked" and
          text == "idemq parked the task: effect_error", (name, text, state))
    print(json.dumps({"failures": failures}))
    sys.exit(1 if failures else 0)

if mode == "one":
    # check_celery's kill case: one task, answered after idemq was killed
    # between its commit and its reply, and started again
    res = send("shop.charge", kwargs={"order_id": f"{prefix}-K", "amount": 9}).get(timeout=40)
    check("answered after the kill", res.get("charged") == 9, res)
    print(json.dumps({"result": res, "failures": failures}))
    sys.exit(1 if failures else 0)

# 1. a task applied once; the same business key sent again (a new task id)
#    and the same message sent again (the same task id) are answered with the
#    first result
first = send("shop.charge", kwargs={"order_id": f"{prefix}-A", "amount": 5}, args=("x",))
r1 = first.get(timeout=TIMEOUT)
check("first result", r1.get("charged") == 5 and r1.get("key") == f"{prefix}-A"
      and r1.get("task") == "shop.charge" and r1.get("args") == ["x"], r1)
again = send("shop.charge", kwargs={"order_id": f"{prefix}-A", "amount": 5}, args=("x",))
r2 = again.get(timeout=TIMEOUT)
check("duplicate answered with the first result", r2 == r1, f"{r2} != {r1}")
same_id = send("shop.charge", kwargs={"order_id": f"{prefix}-A", "amount": 5}, args=("x",),
               task_id=first.id)
r3 = same_id.get(timeout=TIMEOUT)
check("re-sent task id answered with the first result", r3 == r1, f"{r3} != {r1}")
summary["result"] = r1

# 2. apply_async through a task signature, protocol 2, another key
sig = app.signature("shop.charge", kwargs={"order_id": f"{prefix}-B", "amount": 7})
r4 = sig.apply_async(exchange=exchange, routing_key=rk, declare=[]).get(timeout=TIMEOUT)
check("apply_async", r4.get("charged") == 7, r4)

# 3. a pickle task: parked, never decoded; the client gets a FAILURE it reads
pick = send("shop.charge", kwargs={"order_id": f"{prefix}-P", "amount": 1}, serializer="pickle")
name, text, state = failure_of(pick)
check("pickle answered FAILURE", name == "IdemqParked" and "celery_pickle" in text
      and state == "FAILURE", (name, text, state))
summary["pickle"] = [name, text]

# 4. an unknown task name: parked as celery_unknown_task
unk = send("shop.unknown", kwargs={"order_id": f"{prefix}-U", "amount": 1})
name, text, state = failure_of(unk)
check("unknown task answered FAILURE", name == "IdemqParked" and "celery_unknown_task" in text,
      (name, text, state))

# 5. the effect refuses (a permanent error): parked, FAILURE with the reason
ref = send("shop.refuse", kwargs={"order_id": f"{prefix}-R", "amount": 1})
name, text, state = failure_of(ref)
check("refused answered FAILURE with the park's code and reason", name == "IdemqParked"
      and text == f"idemq parked the task: effect_error: card declined for {prefix}-R",
      (name, text, state))

# 6. an expired task: revoked, not run. send_task turns a past `expires`
#    into AMQP expiration 0 (the broker may drop it), so the message is
#    built and sent the way send_task does, without that property.
tid = str(uuid.uuid4())
past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
msg = app.amqp.create_task_message(tid, "shop.charge", [], {"order_id": f"{prefix}-E",
                                                            "amount": 1}, expires=past)
with app.producer_or_acquire() as producer:
    app.backend.on_task_call(producer, tid)
    app.amqp.send_task_message(producer, "shop.charge", msg, exchange=exchange,
                               routing_key=rk, declare=[], reply_to=app.backend.oid,
                               serializer="json")
exp = app.AsyncResult(tid)
name, text, state = failure_of(exp)
check("expired answered REVOKED", name == "TaskRevokedError" and state == "REVOKED"
      and "expired" in text, (name, text, state))

# 7. countdown: held on the broker, then applied
t0 = time.monotonic()
cd = send("shop.charge", kwargs={"order_id": f"{prefix}-C", "amount": 3}, countdown=1.5)
r5 = cd.get(timeout=TIMEOUT)
waited = time.monotonic() - t0
check("countdown applied after its eta", r5.get("charged") == 3 and waited >= 1.4,
      f"{r5} after {waited:.2f} s")
summary["countdown_s"] = round(waited, 2)

# 8. ignore_result: applied, no reply (check_celery counts the effect)
send("shop.charge", kwargs={"order_id": f"{prefix}-I", "amount": 2}, ignore_result=True)

# 9. task protocol 1 (everything in the body), from a real Celery client
#    configured for it (task_protocol = 1), the rpc:// reply as for 2
app1 = celery.Celery("producer-v1", broker=url, backend="rpc://")
app1.conf.update(app.conf)
app1.conf.task_protocol = 1
v1 = app1.send_task("shop.charge", args=["y"], kwargs={"order_id": f"{prefix}-V1", "amount": 4},
                    exchange=exchange, routing_key=rk, declare=[])
r6 = v1.get(timeout=TIMEOUT)
check("protocol 1 applied", r6.get("charged") == 4 and r6.get("key") == f"{prefix}-V1"
      and r6.get("args") == ["y"], r6)
v1again = app1.send_task("shop.charge", args=["y"], kwargs={"order_id": f"{prefix}-V1",
                                                            "amount": 4},
                         exchange=exchange, routing_key=rk, declare=[])
r7 = v1again.get(timeout=TIMEOUT)
check("protocol 1 duplicate answered with the first result", r7 == r6, f"{r7} != {r6}")

summary["failures"] = failures
print(json.dumps(summary))
for f in failures:
    print("FAIL " + f, file=sys.stderr)
sys.exit(1 if failures else 0)
