-- idemq ledger, version 12 (issue 20): operator actions on failure groups.
-- `idemq parked redrive|discard|archive` records each action (who, when,
-- why, what it selected, how many it did) and a row per park it touched, so
-- `idemq jobs show KEY` tells it. New tables only: nothing existing is
-- altered or locked. The grouping functions are in ledger/functions_groups.sql.
SET LOCAL lock_timeout = '5s';

CREATE TABLE idemq.operator_actions (
    id          bigserial PRIMARY KEY,
    action      text NOT NULL CHECK (action IN ('redrive', 'discard', 'archive')),
    actor       text NOT NULL,
    reason      text,
    selection   text NOT NULL,
    selected    integer NOT NULL DEFAULT 0 CHECK (selected >= 0),
    done        integer NOT NULL DEFAULT 0 CHECK (done >= 0),
    started_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at timestamptz
);
COMMENT ON TABLE idemq.operator_actions IS
  'Every operator action on parked messages by group or filter (idemq parked '
  'redrive|discard|archive): who (actor), why (reason), what (selection: the '
  'group id and filters), how many parks it selected and did; finished_at NULL: '
  'interrupted. A dry run records nothing.';

CREATE TABLE idemq.operator_action_keys (
    action_id bigint NOT NULL REFERENCES idemq.operator_actions (id),
    park_id   bigint NOT NULL,
    key       text,
    outcome   text NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (action_id, park_id)
);
CREATE INDEX operator_action_keys_key_idx ON idemq.operator_action_keys (key);
COMMENT ON TABLE idemq.operator_action_keys IS
  'The parks an operator action touched, one row each, with what it did to them '
  '(redriven, discarded, archived, or skipped and why).';
