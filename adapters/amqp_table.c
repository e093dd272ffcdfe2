/*
 * amqp_table: bounded AMQP table -> JSON conversion and JSON -> table (see
 * amqp_table.h). Reading keeps a budget (depth, fields, bytes) shared by
 * the whole table; the recursion depth is bounded by max_depth, so the
 * stack use is too.
 */
#include "amqp_table.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "job.h"

struct budget {
    const struct amqp_table_limits *lim;
    struct amqp_table_report *rep;
};

void amqp_table_default_limits(struct amqp_table_limits *l)
{
    l->max_depth = AMQP_TABLE_MAX_DEPTH;
    l->max_fields = AMQP_TABLE_MAX_FIELDS;
    l->max_bytes = AMQP_TABLE_MAX_BYTES;
}

static void over(struct budget *b, idemq_err_t err)
{
    if (b->rep->err == IDEMQ_OK)
        b->rep->err = err;
}

/* Takes fields and bytes from the budget; false (and nothing taken) when
 * that would go over it. */
static bool take(struct budget *b, int fields, size_t bytes)
{
    if (b->rep->fields + fields > b->lim->max_fields ||
        b->rep->bytes + bytes > b->lim->max_bytes) {
        over(b, IDEMQ_ERR_HEADERS_TOO_LARGE);
        return false;
    }
    b->rep->fields += fields;
    b->rep->bytes += bytes;
    return true;
}

json_t *amqp_table_bytes_to_json(amqp_bytes_t v)
{
    static const char hexd[] = "0123456789abcdef";
    char *hex;
    json_t *o;

    if (job_utf8_valid(v.bytes, v.len))
        return json_stringn(v.len ? v.bytes : "", v.len);
    /* Not text: keep it visible and unambiguous as hex. */
    if (!(hex = malloc(v.len * 2 + 1)))
        return NULL;
    for (size_t i = 0; i < v.len; i++) {
        hex[2 * i] = hexd[((unsigned char *)v.bytes)[i] >> 4];
        hex[2 * i + 1] = hexd[((unsigned char *)v.bytes)[i] & 15];
    }
    hex[v.len * 2] = '\0';
    o = json_pack("{s:s}", "$bytes_hex", hex);
    free(hex);
    return o;
}

static json_t *field(const amqp_field_value_t *v, int depth, struct budget *b);

static json_t *real(double d) { return isfinite(d) ? json_real(d) : json_null(); }

static json_t *table(const amqp_table_t *t, int depth, struct budget *b)
{
    json_t *o = json_object();
    if (depth > b->rep->depth)
        b->rep->depth = depth;
    for (int i = 0; o && i < t->num_entries; i++) {
        const amqp_table_entry_t *e = &t->entries[i];
        char *name;
        json_t *val;
        if (!job_utf8_valid(e->key.bytes, e->key.len)) {
            b->rep->skipped_names++;
            continue;
        }
        if (!take(b, 1, e->key.len))
            break;
        if (!(name = strndup(e->key.len ? e->key.bytes : "", e->key.len)))
            goto nomem;
        val = field(&e->value, depth, b);
        if (!val || json_object_set_new(o, name, val)) {
            free(name);
            goto nomem;
        }
        free(name);
    }
    return o;
nomem:
    json_decref(o);
    return NULL;
}

static json_t *array(const amqp_array_t *a, int depth, struct budget *b)
{
    json_t *arr = json_array();
    if (depth > b->rep->depth)
        b->rep->depth = depth;
    for (int i = 0; arr && i < a->num_entries; i++) {
        json_t *val;
        if (!take(b, 1, 0))
            break;
        if (!(val = field(&a->entries[i], depth, b)) || json_array_append_new(arr, val)) {
            json_decref(arr);
            return NULL;
        }
    }
    return arr;
}

/* One value; nested tables and arrays one level deeper (left empty past
 * max_depth). */
static json_t *field(const amqp_field_value_t *v, int depth, struct budget *b)
{
    switch (v->kind) {
    case AMQP_FIELD_KIND_BOOLEAN: return json_boolean(v->value.boolean);
    case AMQP_FIELD_KIND_I8: return json_integer(v->value.i8);
    case AMQP_FIELD_KIND_U8: return json_integer(v->value.u8);
    case AMQP_FIELD_KIND_I16: return json_integer(v->value.i16);
    case AMQP_FIELD_KIND_U16: return json_integer(v->value.u16);
    case AMQP_FIELD_KIND_I32: return json_integer(v->value.i32);
    case AMQP_FIELD_KIND_U32: return json_integer(v->value.u32);
    case AMQP_FIELD_KIND_I64: return json_integer(v->value.i64);
    case AMQP_FIELD_KIND_U64: return json_integer((json_int_t)v->value.u64);
    case AMQP_FIELD_KIND_F32: return real(v->value.f32);
    case AMQP_FIELD_KIND_F64: return real(v->value.f64);
    case AMQP_FIELD_KIND_TIMESTAMP: return json_integer((json_int_t)v->value.u64);
    case AMQP_FIELD_KIND_DECIMAL:
        return json_pack("{s:i,s:I}", "decimals", v->value.decimal.decimals, "value",
                         (json_int_t)v->value.decimal.value);
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES:
        if (!take(b, 0, v->value.bytes.len))
            return json_null();
        return amqp_table_bytes_to_json(v->value.bytes);
    case AMQP_FIELD_KIND_TABLE:
        if (depth + 1 > b->lim->max_depth) {
            over(b, IDEMQ_ERR_HEADERS_TOO_DEEP);
            b->rep->depth = b->lim->max_depth + 1;
            return json_object();
        }
        return table(&v->value.table, depth + 1, b);
    case AMQP_FIELD_KIND_ARRAY:
        if (depth + 1 > b->lim->max_depth) {
            over(b, IDEMQ_ERR_HEADERS_TOO_DEEP);
            b->rep->depth = b->lim->max_depth + 1;
            return json_array();
        }
        return array(&v->value.array, depth + 1, b);
    case AMQP_FIELD_KIND_VOID: return json_null();
    }
    return json_null();
}

json_t *amqp_table_to_json(const amqp_table_t *t, const struct amqp_table_limits *lim,
                           struct amqp_table_report *rep)
{
    struct amqp_table_limits def;
    struct budget b;

    if (!lim) {
        amqp_table_default_limits(&def);
        lim = &def;
    }
    memset(rep, 0, sizeof *rep);
    b.lim = lim;
    b.rep = rep;
    return table(t, 1, &b);
}

static int from_json(json_t *v, amqp_field_value_t *f, amqp_pool_t *pool);

int amqp_table_from_json(json_t *v, amqp_table_t *t, amqp_pool_t *pool)
{
    amqp_field_value_t f;
    t->num_entries = 0;
    t->entries = NULL;
    if (!json_is_object(v) || !json_object_size(v))
        return 0;
    if (from_json(v, &f, pool))
        return -1;
    *t = f.value.table;
    return 0;
}

/* JSON -> AMQP field; strings and names point into v; nested tables and
 * arrays are allocated in the pool. The JSON was built by idemq (headers it
 * read within the limits, plus its own), so its depth is bounded. */
static int from_json(json_t *v, amqp_field_value_t *f, amqp_pool_t *pool)
{
    if (json_is_string(v)) {
        f->kind = AMQP_FIELD_KIND_UTF8;
        f->value.bytes.bytes = (void *)json_string_value(v);
        f->value.bytes.len = json_string_length(v);
    } else if (json_is_integer(v)) {
        f->kind = AMQP_FIELD_KIND_I64;
        f->value.i64 = json_integer_value(v);
    } else if (json_is_boolean(v)) {
        f->kind = AMQP_FIELD_KIND_BOOLEAN;
        f->value.boolean = json_is_true(v);
    } else if (json_is_real(v)) {
        f->kind = AMQP_FIELD_KIND_F64;
        f->value.f64 = json_real_value(v);
    } else if (json_is_object(v)) {
        const char *k;
        json_t *e;
        int i = 0;
        f->kind = AMQP_FIELD_KIND_TABLE;
        f->value.table.num_entries = (int)json_object_size(v);
        f->value.table.entries =
            amqp_pool_alloc(pool, sizeof(amqp_table_entry_t) * json_object_size(v) + 1);
        if (!f->value.table.entries)
            return -1;
        json_object_foreach(v, k, e)
        {
            f->value.table.entries[i].key = amqp_cstring_bytes(k);
            if (from_json(e, &f->value.table.entries[i].value, pool))
                return -1;
            i++;
        }
    } else if (json_is_array(v)) {
        size_t n = json_array_size(v);
        f->kind = AMQP_FIELD_KIND_ARRAY;
        f->value.array.num_entries = (int)n;
        f->value.array.entries = amqp_pool_alloc(pool, sizeof(amqp_field_value_t) * n + 1);
        if (!f->value.array.entries)
            return -1;
        for (size_t i = 0; i < n; i++)
            if (from_json(json_array_get(v, i), &f->value.array.entries[i], pool))
                return -1;
    } else {
        f->kind = AMQP_FIELD_KIND_VOID;
    }
    return 0;
}

static size_t value_wire_size(const amqp_field_value_t *v, size_t *longest_name)
{
    size_t n = 1; /* the kind */
    switch (v->kind) {
    case AMQP_FIELD_KIND_BOOLEAN:
    case AMQP_FIELD_KIND_I8:
    case AMQP_FIELD_KIND_U8:
        return n + 1;
    case AMQP_FIELD_KIND_I16:
    case AMQP_FIELD_KIND_U16:
        return n + 2;
    case AMQP_FIELD_KIND_I32:
    case AMQP_FIELD_KIND_U32:
    case AMQP_FIELD_KIND_F32:
        return n + 4;
    case AMQP_FIELD_KIND_I64:
    case AMQP_FIELD_KIND_U64:
    case AMQP_FIELD_KIND_F64:
    case AMQP_FIELD_KIND_TIMESTAMP:
        return n + 8;
    case AMQP_FIELD_KIND_DECIMAL:
        return n + 5;
    case AMQP_FIELD_KIND_UTF8:
    case AMQP_FIELD_KIND_BYTES:
        return n + 4 + v->value.bytes.len;
    case AMQP_FIELD_KIND_ARRAY:
        n += 4;
        for (int i = 0; i < v->value.array.num_entries; i++)
            n += value_wire_size(&v->value.array.entries[i], longest_name);
        return n;
    case AMQP_FIELD_KIND_TABLE:
        return n + amqp_table_wire_size(&v->value.table, longest_name);
    default: /* void */
        return n;
    }
}

size_t amqp_table_wire_size(const amqp_table_t *t, size_t *longest_name)
{
    size_t n = 4;
    for (int i = 0; i < t->num_entries; i++) {
        const amqp_table_entry_t *e = &t->entries[i];
        if (e->key.len > *longest_name)
            *longest_name = e->key.len;
        n += 1 + e->key.len + value_wire_size(&e->value, longest_name);
    }
    return n;
}
