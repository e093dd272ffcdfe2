/*
 * Unit tests of trace: which W3C traceparent and tracestate values a
 * producer sends are passed on (the spec's version-00 shape, a later
 * version cut to it), and which are dropped (case, zeros, version ff,
 * lengths, non-strings, controls, too many members).
 */
#include <check.h>

#include "check_run.h"
#include <stdlib.h>
#include <string.h>

#include "trace.h"
#include "trace_export.h"

#define TP "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

static bool tp(const char *s)
{
    return trace_parent_valid(s, strlen(s));
}

START_TEST(test_parent_shapes)
{
    ck_assert(tp(TP));
    ck_assert(tp("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"));
    /* a later version: the version-00 fields, then '-' and more */
    ck_assert(tp("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future"));
    ck_assert(!tp("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x"));
    ck_assert(!tp("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-"));
    ck_assert(!tp("ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"));
    ck_assert(!tp("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01"));
    ck_assert(!tp("00-00000000000000000000000000000000-00f067aa0ba902b7-01"));
    ck_assert(!tp("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"));
    ck_assert(!tp("00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01"));
    ck_assert(!tp("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1"));
    ck_assert(!tp(""));
    ck_assert(!trace_parent_valid(NULL, 0));
    ck_assert(!trace_parent_valid(TP "\0", sizeof TP)); /* a NUL inside the value */
}
END_TEST

static bool ts(const char *s)
{
    return trace_state_valid(s, strlen(s));
}

START_TEST(test_state_shapes)
{
    char big[600];
    ck_assert(ts("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"));
    ck_assert(!ts(""));
    ck_assert(!ts("a=1\nb=2"));
    ck_assert(!ts("=novalue"));
    ck_assert(!ts("a=\xc3\xa9"));
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    ck_assert(!ts(big));
    big[512] = '\0';
    ck_assert(ts(big));
    /* 33 members */
    big[0] = '\0';
    for (int i = 0; i < 33; i++)
        strcat(big, i ? ",k=v" : "k=v");
    ck_assert(!ts(big));
}
END_TEST

START_TEST(test_from_headers)
{
    struct trace_ctx c;
    json_t *h = json_pack("{s:s, s:s}", "traceparent", TP, "tracestate", "rojo=1");
    ck_assert(trace_from_headers(h, &c));
    ck_assert_str_eq(c.parent, TP);
    ck_assert_str_eq(c.state, "rojo=1");
    json_decref(h);
    /* a later version is cut to the version-00 fields */
    h = json_pack("{s:s}", "traceparent",
                  "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra");
    ck_assert(trace_from_headers(h, &c));
    ck_assert_str_eq(c.parent, "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    ck_assert_str_eq(c.state, "");
    json_decref(h);
    /* not a string, or invalid: nothing, and no tracestate without it */
    h = json_pack("{s:i, s:s}", "traceparent", 7, "tracestate", "rojo=1");
    ck_assert(!trace_from_headers(h, &c));
    ck_assert_str_eq(c.parent, "");
    ck_assert_str_eq(c.state, "");
    json_decref(h);
    h = json_pack("{s:s, s:s}", "traceparent", TP, "tracestate", "a=1\r\nb=2");
    ck_assert(trace_from_headers(h, &c));
    ck_assert_str_eq(c.state, "");
    json_decref(h);
    ck_assert(!trace_from_headers(NULL, &c));
    h = json_array();
    ck_assert(!trace_from_headers(h, &c));
    json_decref(h);
}
END_TEST

/* idemq's own span: a child of the producer's sampled span, a new trace
 * without one, none under an unsampled parent; what continues downstream. */
START_TEST(test_job_span)
{
    struct trace_job t;
    char tp[TRACE_PARENT_LEN + 1], hex[33];
    json_t *h = json_pack("{s:s}", "traceparent", TP);
    trace_job_begin(&t, h, true);
    ck_assert(t.span);
    trace_hex(t.trace_id, 16, hex);
    ck_assert_str_eq(hex, "4bf92f3577b34da6a3ce929d0e0e4736");
    trace_hex(t.parent_id, 8, hex);
    ck_assert_str_eq(hex, "00f067aa0ba902b7");
    trace_job_parent(&t, tp);
    ck_assert_int_eq(strlen(tp), TRACE_PARENT_LEN);
    ck_assert(strncmp(tp, "00-4bf92f3577b34da6a3ce929d0e0e4736-", 36) == 0);
    ck_assert(strcmp(tp + 36, "00f067aa0ba902b7-01") != 0); /* idemq's span, not the parent */
    ck_assert(trace_parent_valid(tp, strlen(tp)));
    /* without spans: the producer's context as it came */
    trace_job_begin(&t, h, false);
    ck_assert(!t.span);
    trace_job_parent(&t, tp);
    ck_assert_str_eq(tp, TP);
    json_decref(h);
    /* not sampled by the producer: no span, its context passed on */
    h = json_pack("{s:s}", "traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
    trace_job_begin(&t, h, true);
    ck_assert(!t.span);
    trace_job_parent(&t, tp);
    ck_assert_str_eq(tp, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00");
    json_decref(h);
    /* no context: a new trace, sampled */
    trace_job_begin(&t, NULL, true);
    ck_assert(t.span);
    trace_job_parent(&t, tp);
    ck_assert(trace_parent_valid(tp, strlen(tp)));
    ck_assert(strcmp(tp + 53, "01") == 0);
    trace_job_begin(&t, NULL, false);
    trace_job_parent(&t, tp);
    ck_assert_str_eq(tp, "");
}
END_TEST

/* A provider call's span: CLIENT, a child of the job's span, in the same
 * trace, with its status; ERROR when no answer came. */
START_TEST(test_call_span)
{
    struct conf c;
    struct conf_input in;
    struct trace_span sp[2];
    json_t *root, *spans, *s0, *s1;
    char *body, hex[33];
    memset(&c, 0, sizeof c);
    memset(&in, 0, sizeof in);
    memset(sp, 0, sizeof sp);
    in.queue = "q";
    in.name = "in";
    c.tracing_service_name = "svc";
    for (int i = 0; i < 2; i++) {
        trace_job_begin(&sp[i].t, NULL, true);
        sp[i].in = &in;
        sp[i].call_op = "call";
        sp[i].call_method = "POST";
        sp[i].call_class = i ? "unknown" : "success";
        sp[i].call_status = i ? 0 : 201;
        trace_new_span_id(sp[i].call_span_id);
    }
    body = trace_export_body(&c, sp, 2);
    ck_assert_ptr_nonnull(body);
    root = json_loads(body, 0, NULL);
    ck_assert_msg(root != NULL, "not JSON: %s", body);
    spans = json_object_get(json_array_get(json_object_get(json_array_get(json_object_get(root,
        "resourceSpans"), 0), "scopeSpans"), 0), "spans");
    s0 = json_array_get(spans, 0);
    s1 = json_array_get(spans, 1);
    ck_assert_int_eq(json_integer_value(json_object_get(s0, "kind")), 3);
    trace_hex(sp[0].t.span_id, 8, hex);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "parentSpanId")), hex);
    trace_hex(sp[0].call_span_id, 8, hex);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "spanId")), hex);
    trace_hex(sp[0].t.trace_id, 16, hex);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "traceId")), hex);
    ck_assert_ptr_nonnull(strstr(body, "\"intValue\":\"201\""));
    ck_assert_ptr_null(json_object_get(s0, "status"));
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(s1, "status"), "code")), 2);
    json_decref(root);
    free(body);
}
END_TEST

/* The OTLP JSON body: valid JSON whatever a name holds, ids in hex, the
 * producer's span as the parent, times as strings, ERROR for a park. */
START_TEST(test_export_body)
{
    struct conf c;
    struct conf_input in;
    struct trace_span sp[2];
    json_t *h = json_pack("{s:s, s:s}", "traceparent", TP, "tracestate", "a=\"b\\c");
    json_t *root, *spans, *s0;
    char *body;
    memset(&c, 0, sizeof c);
    memset(&in, 0, sizeof in);
    memset(sp, 0, sizeof sp);
    in.queue = "q\"uote\x01\\";
    in.name = "in";
    c.inputs = &in;
    c.n_inputs = 1;
    c.tracing_service_name = "svc";
    sp[0].in = sp[1].in = &in;
    trace_job_begin(&sp[0].t, h, true);
    sp[0].start_ns = 1000000000000000001LL;
    sp[0].end_ns = 1000000000000000002LL;
    sp[0].attempt = 2;
    sp[0].outcome = TRACE_PARKED;
    trace_job_begin(&sp[1].t, NULL, true);
    sp[1].outcome = TRACE_APPLIED;
    body = trace_export_body(&c, sp, 2);
    ck_assert_ptr_nonnull(body);
    root = json_loads(body, 0, NULL);
    ck_assert_msg(root != NULL, "not JSON: %s", body);
    spans = json_object_get(json_array_get(json_object_get(json_array_get(json_object_get(root,
        "resourceSpans"), 0), "scopeSpans"), 0), "spans");
    ck_assert_int_eq(json_array_size(spans), 2);
    s0 = json_array_get(spans, 0);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "name")), "process q\"uote\x01\\");
    ck_assert_str_eq(json_string_value(json_object_get(s0, "traceId")),
                     "4bf92f3577b34da6a3ce929d0e0e4736");
    ck_assert_str_eq(json_string_value(json_object_get(s0, "parentSpanId")), "00f067aa0ba902b7");
    ck_assert_int_eq(strlen(json_string_value(json_object_get(s0, "spanId"))), 16);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "traceState")), "a=\"b\\c");
    ck_assert_str_eq(json_string_value(json_object_get(s0, "startTimeUnixNano")),
                     "1000000000000000001");
    ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(s0, "status"), "code")), 2);
    ck_assert_ptr_null(json_object_get(json_array_get(spans, 1), "parentSpanId"));
    ck_assert_ptr_null(json_object_get(json_array_get(spans, 1), "status"));
    json_decref(root);
    json_decref(h);
    free(body);
}
END_TEST

/* A batch span: CLIENT, its links in hex; a settle span names its parent
 * and its operation; no "links" member when the batch had no context. */
START_TEST(test_batch_span)
{
    struct conf c;
    struct conf_input in;
    struct trace_span sp[2];
    struct trace_link link;
    json_t *root, *spans, *s0, *s1, *l;
    char *body, hex[33];
    memset(&c, 0, sizeof c);
    memset(&in, 0, sizeof in);
    memset(sp, 0, sizeof sp);
    in.queue = "q";
    in.name = "in";
    c.tracing_service_name = "svc";
    memset(link.trace_id, 0xab, sizeof link.trace_id);
    memset(link.span_id, 0xcd, sizeof link.span_id);
    for (int i = 0; i < 2; i++) {
        trace_job_begin(&sp[i].t, NULL, true);
        sp[i].in = &in;
        sp[i].batch_size = 3;
    }
    sp[0].batch_op = "receive";
    sp[0].links = &link;
    sp[0].nlinks = 1;
    sp[1].batch_op = "settle";
    sp[1].settle_op = "ack";
    sp[1].batch_parent = true;
    memcpy(sp[1].t.parent_id, sp[0].t.span_id, 8);
    body = trace_export_body(&c, sp, 2);
    ck_assert_ptr_nonnull(body);
    root = json_loads(body, 0, NULL);
    ck_assert_msg(root != NULL, "not JSON: %s", body);
    spans = json_object_get(json_array_get(json_object_get(json_array_get(json_object_get(root,
        "resourceSpans"), 0), "scopeSpans"), 0), "spans");
    s0 = json_array_get(spans, 0);
    s1 = json_array_get(spans, 1);
    ck_assert_int_eq(json_integer_value(json_object_get(s0, "kind")), 3);
    ck_assert_int_eq(json_integer_value(json_object_get(s1, "kind")), 3);
    ck_assert_str_eq(json_string_value(json_object_get(s0, "name")), "receive q");
    ck_assert_str_eq(json_string_value(json_object_get(s1, "name")), "ack q");
    ck_assert_ptr_null(json_object_get(s0, "parentSpanId"));
    trace_hex(sp[0].t.span_id, 8, hex);
    ck_assert_str_eq(json_string_value(json_object_get(s1, "parentSpanId")), hex);
    ck_assert_int_eq(json_array_size(json_object_get(s0, "links")), 1);
    l = json_array_get(json_object_get(s0, "links"), 0);
    ck_assert_str_eq(json_string_value(json_object_get(l, "traceId")),
                     "abababababababababababababababab");
    ck_assert_str_eq(json_string_value(json_object_get(l, "spanId")), "cdcdcdcdcdcdcdcd");
    ck_assert_ptr_null(json_object_get(s1, "links"));
    ck_assert_ptr_nonnull(strstr(body, "\"messaging.batch.message_count\",\"value\":{\"intValue\":\"3\"}"));
    json_decref(root);
    free(body);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("trace");
    TCase *tc = tcase_create("trace");
    tcase_add_test(tc, test_parent_shapes);
    tcase_add_test(tc, test_state_shapes);
    tcase_add_test(tc, test_from_headers);
    tcase_add_test(tc, test_job_span);
    tcase_add_test(tc, test_export_body);
    tcase_add_test(tc, test_call_span);
    tcase_add_test(tc, test_batch_span);
    suite_add_tcase(s, tc);
    return check_run(s);
}
