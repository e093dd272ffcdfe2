-- Every idemq function runs with a pinned search_path, never the caller's
-- (the CVE-2018-1058 class: a caller's schema must not be able to shadow
-- an operator or function a ledger function uses). Effect functions called
-- from apply_batch run under it too: they schema-qualify their names, or
-- pin their own search_path. Applied after every other function
-- file (CMakeLists.txt, IDEMQ_FUNCTIONS), so it covers them all.
DO $pin$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure
               FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
              WHERE n.nspname = 'idemq' AND p.prokind = 'f'
    LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = pg_catalog, idemq, pg_temp', f);
    END LOOP;
END
$pin$;
