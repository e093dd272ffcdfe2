/*
 * Integration tests of failure groups: `idemq parked groups`
 * (fingerprint, masking, counts) and `idemq parked redrive|discard|archive`
 * by group (dry runs, the actions end to end, their records in
 * idemq.operator_actions and in `jobs show`). Real RabbitMQ and PostgreSQL
 * (see itest.h).
 */
#include <check.h>

#include "check_run.h"
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "topology.h"

#define EFFECTS_FOR "SELECT count(*) FROM idemq_test.effects WHERE key = $1"
#define OPEN_PARKS "SELECT count(*) FROM idemq.parked WHERE source_queue = $1"

/* An effect that fails with 22023 and a reason full of numbers and a quoted
 * string while its test's row is in idemq_test.groups_broken. */
static const char *effect_sql =
    "CREATE TABLE IF NOT EXISTS idemq_test.groups_broken (test text PRIMARY KEY);"
    "CREATE OR REPLACE FUNCTION idemq_test.groups_effect(p_key text, p_payload jsonb,"
    " p_meta jsonb) RETURNS jsonb LANGUAGE plpgsql AS $fn$ BEGIN"
    " IF EXISTS (SELECT 1 FROM idemq_test.groups_broken b WHERE b.test = p_payload->>'test')"
    " THEN RAISE EXCEPTION 'order % of customer \"%\" rejected: limit %',"
    " p_payload->>'order', p_payload->>'customer', p_payload->>'limit' USING ERRCODE = '22023';"
    " END IF; RETURN idemq_test.record(p_key, p_payload, p_meta); END $fn$;";

/* The id of the group of `count` parks in a `parked groups` output, into id. */
static void group_id(const char *out, const char *count, char *id)
{
    char want[64];
    const char *p = out;
    snprintf(want, sizeof want, ": %s park", count);
    id[0] = '\0';
    while ((p = strstr(p, "group ")) != NULL) {
        p += 6;
        if (strspn(p, "0123456789abcdef") == 12 && strncmp(p + 12, want, strlen(want)) == 0) {
            memcpy(id, p, 12);
            id[12] = '\0';
            return;
        }
    }
    ck_abort_msg("no group of %s parks in:\n%s", count, out);
}

/* The masking rule, on its own. */
START_TEST(test_mask_reason)
{
    struct itest t;
    char buf[512];
    itest_setup(&t, "gmask", "idemq_test.record", "", "");
    itest_text(&t,
               "SELECT idemq.mask_reason('key k-1 id 6F1C0A7E-1d2b-4c3d-9e8f-001122334455 at 0x1F"
               " hash deadbeef00 word facade count 42 ''quoted 7'' \"dq\" k-1', $1)",
               "k-1", buf, sizeof buf);
    ck_assert_str_eq(buf, "key <key> id <uuid> at <hex> hash <hex> word facade count <n> <str> "
                          "<str> <key>");
    /* no key: digits of the would-be key are masked as numbers */
    itest_text(&t, "SELECT idemq.mask_reason('job 17 failed', NULL)", NULL, buf, sizeof buf);
    ck_assert_str_eq(buf, "job <n> failed");
    /* two reasons differing only in numbers and quoted text: one group */
    ck_assert_int_eq(
        itest_long(&t,
                   "SELECT count(DISTINCT idemq.park_group('q', 'permanent', 'effect_error',"
                   " '22023', r, k)) FROM (VALUES ('order 1 of \"a\" rejected', 'x1'),"
                   " ('order 22 of \"bb\" rejected', 'x2'), ('x3 order 3 of \"c\" rejected', 'x3'))"
                   " v(r, k)",
                   NULL),
        2);
    itest_teardown(&t);
}
END_TEST

/* Groups, dry runs, a group redrive, a discard and an archive, end to end. */
START_TEST(test_groups_end_to_end)
{
    struct itest t;
    char out[32768], args[1024], sql[1024], dlq[300], ga[16], gb[16], gc[16];
    char a[3][160], b1[160], body[512];
    const char *bodies[1] = {body};
    const char *in;
    itest_setup(&t, "groups", "idemq_test.groups_effect", "", "");
    in = t.conf->inputs[0].name;
    topology_dlq(&t.conf->inputs[0], dlq, sizeof dlq);
    itest_sql(&t, effect_sql);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.groups_broken VALUES ('%s')", t.name);
    itest_sql(&t, sql);
    /* group A: three keys, the effect failing with different numbers */
    for (int i = 0; i < 3; i++) {
        snprintf(a[i], sizeof a[i], "%s:a%d", t.name, i);
        snprintf(body, sizeof body,
                 "{\"job_id\":\"%s\",\"test\":\"%s\",\"order\":%d,\"customer\":\"c-%d\","
                 "\"limit\":%d}",
                 a[i], t.name, 1001 + i * 17, 7 + i, 500 + i * 250);
        itest_publish(&t, bodies, 1);
    }
    /* group B: one key failing with a raised 22023 */
    snprintf(b1, sizeof b1, "%s:b1", t.name);
    snprintf(body, sizeof body, "{\"job_id\":\"%s\",\"raise\":\"22023\"}", b1);
    itest_publish(&t, bodies, 1);
    /* group C: a bad body */
    snprintf(body, sizeof body, "{\"job_id\": nope");
    itest_publish(&t, bodies, 1);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, OPEN_PARKS, t.name), 5);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 5);

    snprintf(args, sizeof args, "parked groups --input %s", in);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "3 groups, 5 open parks") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "reason: order <n> of customer <str> rejected: limit <n>") != NULL,
                  "%s", out);
    ck_assert_msg(strstr(out, a[0]) && strstr(out, a[1]) && strstr(out, a[2]), "%s", out);
    group_id(out, "3", ga);
    /* largest first */
    ck_assert_msg(strstr(out, ga) < strstr(out, ": 1 park,"), "%s", out);
    ck_assert_int_eq(itest_long(&t,
                                "SELECT count(DISTINCT idemq.park_group(source_queue, error_class,"
                                " error_code, sqlstate, reason, key)) FROM idemq.parked"
                                " WHERE key LIKE $1 || ':a%'",
                                t.name),
                     1);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE key = $1",
               b1, gb, sizeof gb);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE source_queue = $1 AND key IS NULL",
               t.name, gc, sizeof gc);
    ck_assert_str_ne(gb, gc);
    ck_assert_str_ne(ga, gb);

    /* dry runs: exact counts, nothing changed, nothing recorded */
    snprintf(args, sizeof args, "parked redrive --group %s --dry-run", ga);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "the group selects 3 open parks") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "would redrive 3 messages") != NULL, "%s", out);
    snprintf(args, sizeof args, "parked discard --group %s --reason 'not wanted' --dry-run", ga);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "would discard 3 parks") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, OPEN_PARKS, t.name), 5);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 5);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE selection"
                                    " LIKE '%' || $1 || '%'",
                                ga),
                     0);
    /* a discard needs a reason; a group id is 12 hex digits */
    snprintf(args, sizeof args, "parked discard --group %s", ga);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 2);
    ck_assert_int_eq(itest_idemq(&t, "parked archive --group xyz --reason r", out, sizeof out), 2);

    /* the cause fixed, group A redriven: each key applied once */
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.groups_broken WHERE test = '%s'", t.name);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "parked redrive --group %s --actor alice --reason 'limit raised'",
             ga);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "redrove 3 messages") != NULL, "%s", out);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 2);
    itest_run_until_idle(&t, 2);
    for (int i = 0; i < 3; i++) {
        ck_assert_int_eq(itest_long(&t, EFFECTS_FOR, a[i]), 1);
        ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.jobs WHERE key = $1 AND"
                                        " state = 'applied' AND generation = 1",
                                    a[i]),
                         1);
    }
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE action ="
                                    " 'redrive' AND actor = 'alice' AND reason = 'limit raised'"
                                    " AND selected = 3 AND done = 3 AND finished_at IS NOT NULL"
                                    " AND selection LIKE '%' || $1 || '%'",
                                ga),
                     1);
    snprintf(args, sizeof args, "jobs show %s", a[1]);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redriven 1 time(s)") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "redrive, park #") && strstr(out, "redriven, by alice: limit raised"),
                  "%s", out);

    /* group B discarded: closed as not applied, recorded, in jobs show; a
     * redrive of its dead-letter copy is then a duplicate */
    snprintf(args, sizeof args, "parked discard --group %s --actor bob --reason 'bad order'", gb);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "discarded 1 of 1 park by bob: bad order") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", b1), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE key = $1 AND"
                                    " resolution = 'discarded: bad order' AND resolved_by = 'bob'",
                                b1),
                     1);
    snprintf(args, sizeof args, "jobs show %s", b1);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "discarded, by bob: bad order") != NULL, "%s", out);
    ck_assert_msg(strstr(out, "redriven 0 time(s)") != NULL, "%s", out);
    snprintf(args, sizeof args, "redrive --key %s", b1);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "redrove 1 message") != NULL, "%s", out);
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key = $1", b1), 0);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.attempts WHERE key = $1 AND"
                                    " outcome = 'duplicate'",
                                b1),
                     1);

    /* group C archived: closed, its dead-letter copy left in place */
    snprintf(args, sizeof args, "parked archive --group %s --reason 'kept for the producer team'",
             gc);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "archived 1 of 1 park") != NULL, "%s", out);
    ck_assert_int_eq(itest_long(&t, OPEN_PARKS, t.name), 0);
    ck_assert_int_eq(itest_queue_ready(&t, dlq), 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.park_history WHERE source_queue ="
                                    " $1 AND key IS NULL AND resolution ="
                                    " 'archived: kept for the producer team'",
                                t.name),
                     1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions a JOIN"
                                    " idemq.operator_action_keys k ON k.action_id = a.id"
                                    " WHERE a.action = 'archive' AND k.outcome = 'archived' AND"
                                    " a.selection LIKE '%' || $1 || '%'",
                                gc),
                     1);
    snprintf(args, sizeof args, "parked groups --input %s", in);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    ck_assert_msg(strstr(out, "0 groups, 0 open parks") != NULL, "%s", out);
    itest_teardown(&t);
}
END_TEST

/* The group actions of the CLI (and so of the console, which calls the
 * same groups_act) work under the role `idemq migrate --grant` prepares:
 * it may write the ledger only through SECURITY DEFINER functions, and
 * the action, its per-park rows and its closed parks are all recorded. */
START_TEST(test_group_actions_least_privilege)
{
    struct itest t;
    char out[32768], args[1024], sql[1024], role[64], dsn[512], g[16], a[3][160], body[512];
    char owner_dsn[512];
    const char *bodies[1] = {body};
    char *u;
    itest_setup(&t, "grole", "idemq_test.groups_effect", "", "");
    itest_sql(&t, effect_sql);
    snprintf(sql, sizeof sql, "INSERT INTO idemq_test.groups_broken VALUES ('%s')", t.name);
    itest_sql(&t, sql);
    for (int i = 0; i < 3; i++) {
        snprintf(a[i], sizeof a[i], "%s:a%d", t.name, i);
        snprintf(body, sizeof body,
                 "{\"job_id\":\"%s\",\"test\":\"%s\",\"order\":%d,\"customer\":\"c\","
                 "\"limit\":%d}",
                 a[i], t.name, 1001 + i, 500 + i);
        itest_publish(&t, bodies, 1);
    }
    itest_run_until_idle(&t, 2);
    ck_assert_int_eq(itest_long(&t, OPEN_PARKS, t.name), 3);
    itest_text(&t,
               "SELECT idemq.park_group(source_queue, error_class, error_code, sqlstate, reason,"
               " key) FROM idemq.parked WHERE key = $1",
               a[0], g, sizeof g);
    snprintf(sql, sizeof sql, "DELETE FROM idemq_test.groups_broken WHERE test = '%s'", t.name);
    itest_sql(&t, sql);

    snprintf(role, sizeof role, "%s_ops", t.name);
    snprintf(sql, sizeof sql, "DROP ROLE IF EXISTS %s; CREATE ROLE %s LOGIN", role, role);
    itest_sql(&t, sql);
    snprintf(args, sizeof args, "migrate --grant %s", role);
    ck_assert_int_eq(itest_idemq(&t, args, out, sizeof out), 0);
    snprintf(owner_dsn, sizeof owner_dsn, "%s", getenv("IDEMQ_PG_DSN"));
    snprintf(dsn, sizeof dsn, "%s", owner_dsn);
    ck_assert_ptr_nonnull(u = strstr(dsn, "user="));
    snprintf(u, sizeof dsn - (size_t)(u - dsn), "user=%s", role);
    setenv("IDEMQ_PG_DSN", dsn, 1);
    /* archive one park (by key), redrive one, discard the last */
    snprintf(args, sizeof args, "parked archive --group %s --key %s --reason 'kept aside'", g,
             a[0]);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "archived 1 of 1 park") != NULL, "%s", out);
    snprintf(args, sizeof args, "parked redrive --group %s --key %s", g, a[1]);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "recorded as operator action") != NULL, "%s", out);
    snprintf(args, sizeof args, "parked discard --group %s --key %s --reason 'not needed'", g,
             a[2]);
    ck_assert_msg(itest_idemq(&t, args, out, sizeof out) == 0, "%s", out);
    ck_assert_msg(strstr(out, "discarded 1 of 1 park") != NULL, "%s", out);
    setenv("IDEMQ_PG_DSN", owner_dsn, 1);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_actions WHERE"
                                    " selection LIKE '%' || $1 || '%' AND done = 1 AND"
                                    " finished_at IS NOT NULL",
                                g),
                     3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.operator_action_keys WHERE"
                                    " key LIKE $1 || ':a%'",
                                t.name),
                     3);
    ck_assert_int_eq(itest_long(&t, "SELECT count(*) FROM idemq.parked WHERE key LIKE $1 || ':a%'"
                                    " AND id NOT IN (SELECT park_id FROM"
                                    " idemq.operator_action_keys WHERE outcome = 'redriven')",
                                t.name),
                     0);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", role, role);
    itest_sql(&t, sql);
    itest_teardown(&t);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("groups");
    TCase *tc = tcase_create("groups");
    tcase_set_timeout(tc, itest_ms(120));
    tcase_add_test(tc, test_mask_reason);
    tcase_add_test(tc, test_groups_end_to_end);
    tcase_add_test(tc, test_group_actions_least_privilege);
    suite_add_tcase(s, tc);
    /* least-privilege mode (scripts/test): these again, as the deployment's roles */
    itest_lp_tcase(s, (const TTest *const[]){test_groups_end_to_end, NULL});
    return check_run(s);
}
