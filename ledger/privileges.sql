-- Least privilege, applied after the ledger functions by every
-- `idemq migrate` (part of the repeatable function text, so it is applied
-- again whenever a function is recreated).
--
-- The functions `idemq run` and the operator commands call to write the
-- ledger run with the rights of their owner (the migrating role): the role
-- of `run` then needs EXECUTE on them and SELECT on the tables, and no
-- INSERT, UPDATE, DELETE or DDL (`idemq migrate --grant ROLE` grants that).
-- search_path is pinned, so a caller's objects cannot stand in for the
-- ledger's.
--
-- PUBLIC may execute no function of schema idemq (the last statement):
-- the readers of a key's story and result (job_info, key_history,
-- key_batches, key_attempts, key_outbox) and idemq.maintain are SECURITY
-- DEFINER too, and a role given USAGE on the schema for one function (an
-- application that calls idemq.emit) must not reach them. Each role gets
-- EXECUTE by name (`idemq migrate --grant`, `--grant-operator`,
-- `--grant-app`; ledger/ledger_grants.c). An effect called from them
-- runs with the owner's rights and this search_path too: effects name
-- their tables with a schema (or set their own search_path).
DO $privileges$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN
        SELECT p.oid::regprocedure
          FROM pg_proc p
         WHERE p.pronamespace = 'idemq'::regnamespace
           AND p.proname = ANY (ARRAY[
               'apply_batch', 'record_raced', 'record_failure', 'claim_failed',
               'park_message', 'mark_dead_lettered', 'defer_job', 'lane_parked',
               'take_deferred', 'report_deferred', 'adopt_dead_letter',
               -- provider effects: the flow and the reconciler of run
               'provider_begin', 'provider_result', 'provider_effect_failed',
               'provider_sweep', 'provider_gauges', 'provider_latency',
               -- transaction 2b: the local effect after a committed reference
               'provider_confirmed',
               -- the rescuer of run and the operator commands that
               -- write: `resolve` of a provider key, `archive export`
               'rescue_take', 'rescue_record', 'provider_resolve', 'archive_exported',
               -- observe mode of run
               'observe_batch',
               -- operator actions on parks, of the CLI and the console:
               -- the audit trail and the closing of parks
               'ops_action_begin', 'ops_action_moved', 'ops_action_finish',
               'ops_close_parks', 'erase_key'])
    LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER '
                       'SET search_path = pg_catalog, idemq, pg_temp', f);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$privileges$;

REVOKE ALL ON ALL FUNCTIONS IN SCHEMA idemq FROM PUBLIC;
