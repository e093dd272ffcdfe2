#!/usr/bin/env bash
# check_ledger_fill: the small form of the ledger pre-fill of
# `scripts/bench --ledger-size`, in the default suite so that it
# cannot rot. In a database of its own, against the real servers of
# scripts/services (IDEMQ_AMQP_URL, IDEMQ_PG_DSN):
#   1. scripts/ledger-fill writes 20,000 settled keys (in chunks of 5,000,
#      grown in two steps) and its parks, in history partitions of their
#      own (none in a default partition);
#   2. copies of pre-filled keys, published by `idemq-bench publish
#      --old-keys`, are each acked as a duplicate of the applied key by
#      `idemq run` (the digest matches: no reused key, no effect applied,
#      nothing parked);
#   3. `idemq jobs show` finds a pre-filled key with its batch, and a parked
#      one with its park;
#   4. `idemq maintain` accepts them: 100 days on, their partitions are
#      archived and jobs show still reads them; 401 days on, their claims
#      are pruned past the dedup window and nothing fails.
# Usage (ctest): check_ledger_fill.sh SOURCE_DIR IDEMQ IDEMQ_BENCH
set -euo pipefail
SRC=$1 IDEMQ=$2 BENCH=$3
[[ -n ${IDEMQ_PG_DSN:-} && -n ${IDEMQ_AMQP_URL:-} ]] || { echo "check_ledger_fill: IDEMQ_PG_DSN and IDEMQ_AMQP_URL needed (scripts/services)" >&2; exit 1; }
BASE_DSN=$IDEMQ_PG_DSN
DB=idemq_fill_$$
Q=idemq.fill.$$
TMP=$(mktemp -d /tmp/check-ledger-fill.XXXXXX)
fail() { echo "check_ledger_fill: FAIL: $*" >&2; exit 1; }
cleanup() {
    "$BENCH" reset -c "$TMP/fill.cfg" >/dev/null 2>&1 || true
    command psql "$BASE_DSN" -X -q -c "DROP DATABASE IF EXISTS $DB WITH (FORCE)" >/dev/null 2>&1 || true
    rm -rf "$TMP"
}
trap cleanup EXIT
command psql "$BASE_DSN" -X -q -v ON_ERROR_STOP=1 -c "CREATE DATABASE $DB"
export IDEMQ_PG_DSN="$BASE_DSN dbname=$DB"
q() { command psql "$IDEMQ_PG_DSN" -X -q -At -v ON_ERROR_STOP=1 -c "$1"; }
expect() { # WHAT GOT WANT
    [[ $2 == "$3" ]] || fail "$1: got '$2', want '$3'"
    echo "ok: $1 = $3"
}
cat >"$TMP/fill.cfg" <<EOF
consumer: { id = "bench"; workers = 2; };
log: { level = "info"; };
inputs = ( { name = "fill"; exchange = "$Q"; queue = "$Q"; routing_key = "$Q";
  queue_type = "classic"; effect_function = "idemq_demo.apply_payout"; } );
EOF
"$IDEMQ" migrate -c "$TMP/fill.cfg" >/dev/null
command psql "$IDEMQ_PG_DSN" -X -q -v ON_ERROR_STOP=1 -f "$SRC/ledger/examples/payouts.sql"

# 1. the fill, in two steps
"$SRC/scripts/ledger-fill" --max 20000 --days 5 --chunk 5000 8000 2>/dev/null
out=$("$SRC/scripts/ledger-fill" --days 5 --chunk 5000 20000 2>/dev/null)
[[ $out == "filled=20000 added=12000 "* ]] || fail "second fill step printed '$out'"
expect "applied pre-filled keys" "$(q "SELECT count(*) FROM idemq.jobs WHERE key LIKE 'payout:inv-%' AND state = 'applied' AND attempts = 1 AND batch_id IS NOT NULL")" 20000
expect "keys in batch rows, each with its 32-byte digest" \
    "$(q "SELECT sum(cardinality(keys)) || '/' || bool_and(octet_length(sha256) = 32 * cardinality(keys)) || '/' || count(*) FROM idemq.batches")" "20000/true/200"
expect "each job row's sha256_head is the first 8 bytes of its batch row's digest" \
    "$(q "SELECT count(*) FROM idemq.jobs j JOIN idemq.batches h ON h.at = j.applied_at AND h.id = j.batch_id WHERE j.key LIKE 'payout:inv-%' AND j.sha256_head = substring(h.sha256 FROM (array_position(h.keys, j.key) - 1) * 32 + 1 FOR 8)")" 20000
expect "every job row finds its batch row (at, id)" \
    "$(q "SELECT count(*) FROM idemq.jobs j JOIN idemq.batches b ON b.at = j.applied_at AND b.id = j.batch_id AND j.key = ANY (b.keys)")" 20000
expect "parks (jobs, open parks, permanent_error attempts)" \
    "$(q "SELECT (SELECT count(*) FROM idemq.jobs WHERE state = 'parked') || '/' || (SELECT count(*) FROM idemq.parked) || '/' || (SELECT count(*) FROM idemq.attempts WHERE outcome = 'permanent_error')")" "2/2/2"
expect "recorded copies of pre-filled keys" "$(q "SELECT count(*) FROM idemq.attempts WHERE outcome = 'duplicate'")" 1000
expect "batch partitions whose per-job arrays ANALYZE skips (statistics 0; migration 20)" \
    "$(q "SELECT count(*) FILTER (WHERE a.attstattarget = 0) || '/' || count(*) FROM idemq.history_parts h JOIN pg_attribute a ON a.attrelid = format('idemq.%I', h.relname)::regclass AND a.attname IN ('keys', 'sha256', 'metas', 'results') WHERE h.kind = 'batches' AND h.location = 'hot'")" \
    "$(q "SELECT 4 * count(*) || '/' || 4 * count(*) FROM idemq.history_parts h WHERE h.kind = 'batches' AND h.location = 'hot'")"
q "ANALYZE idemq.batches" >/dev/null
expect "statistics of the batch rows after ANALYZE: at and id only, no per-job array" \
    "$(q "SELECT count(*) FILTER (WHERE attname IN ('at', 'id')) > 0 AND count(*) FILTER (WHERE attname IN ('keys', 'sha256', 'metas', 'results', 'applied', 'dups', 'meta_idx')) = 0 FROM pg_stats WHERE schemaname = 'idemq' AND tablename LIKE 'batches%'")" t
expect "rows in default partitions" "$(q "SELECT (SELECT count(*) FROM idemq.batches_default) + (SELECT count(*) FROM idemq.attempts_default)")" 0
expect "pre-fill partitions registered, attached, hot" \
    "$(q "SELECT count(*) FROM idemq.history_parts WHERE kind IN ('batches', 'attempts') AND attached AND location = 'hot' AND hi <= (SELECT lo FROM idemq_fill.state) + interval '5 days'")" 10

# 2. copies of pre-filled keys are duplicates
"$BENCH" reset -c "$TMP/fill.cfg"
t0=$(q "SELECT clock_timestamp()")
pub=$("$BENCH" publish -c "$TMP/fill.cfg" -n 400 --run fill --dup-pct 0 --old-keys 20000 --old-pct 100)
[[ $pub == *" prefilled=400"* ]] || fail "publish printed '$pub'"
"$IDEMQ" run -c "$TMP/fill.cfg" --until-idle 1 2>"$TMP/run.log" || { tail -n 20 "$TMP/run.log" >&2; fail "idemq run failed"; }
grep -q "received 400 .*applied 0, duplicates 400, .*parked 0" "$TMP/run.log" ||
    fail "idemq run: $(grep 'stopped:' "$TMP/run.log")"
expect "duplicate attempts of pre-filled keys since the publish" \
    "$(q "SELECT count(*) FROM idemq.attempts WHERE outcome = 'duplicate' AND key LIKE 'payout:inv-%' AND started_at >= '$t0'")" 400
expect "effects applied for copies" "$(q "SELECT count(*) FROM idemq_demo.ledger_intents")" 0
expect "pre-filled keys still applied once" "$(q "SELECT count(*) FROM idemq.jobs WHERE key LIKE 'payout:inv-%' AND state = 'applied' AND attempts = 1")" 20000

# 3. jobs show
show=$("$IDEMQ" jobs show -c "$TMP/fill.cfg" payout:inv-12345)
[[ $show == *"state applied"* && $show == *"batch #"*"of 100 jobs"*"the effect was applied here"* ]] || fail "jobs show payout:inv-12345: $show"
echo "ok: jobs show finds payout:inv-12345 applied in its batch"
show=$("$IDEMQ" jobs show -c "$TMP/fill.cfg" payout:bad-19999)
[[ $show == *"state parked"* && $show == *"parked #"* ]] || fail "jobs show payout:bad-19999: $show"
echo "ok: jobs show finds the park of payout:bad-19999"

# 4. maintenance: archive, then prune past the window
later() { q "SELECT to_char((date_trunc('day', now()) + interval '$1 days') AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')"; }
"$IDEMQ" maintain -c "$TMP/fill.cfg" --now "$(later 100)" >"$TMP/m1.log" || { cat "$TMP/m1.log" >&2; fail "maintain (100 days on) failed"; }
expect "pre-fill partitions archived 100 days on" \
    "$(q "SELECT count(*) FROM idemq.history_parts WHERE kind IN ('batches', 'attempts') AND location = 'archive' AND hi <= (SELECT lo FROM idemq_fill.state) + interval '5 days'")" 10
show=$("$IDEMQ" jobs show -c "$TMP/fill.cfg" payout:inv-777)
[[ $show == *"batch #"*"the effect was applied here"* ]] || fail "jobs show from the archive: $show"
echo "ok: jobs show reads payout:inv-777 from the archive"
"$IDEMQ" maintain -c "$TMP/fill.cfg" --now "$(later 401)" >"$TMP/m2.log" || { cat "$TMP/m2.log" >&2; fail "maintain (401 days on) failed"; }
expect "applied pre-filled claims pruned past the dedup window" "$(q "SELECT count(*) FROM idemq.jobs WHERE key LIKE 'payout:inv-%'")" 0
expect "parked keys kept (never pruned)" "$(q "SELECT count(*) FROM idemq.jobs WHERE state = 'parked'")" 2
echo "check_ledger_fill: all passed"
