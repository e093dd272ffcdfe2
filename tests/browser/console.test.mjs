// The web console in a real browser: Debian's chromium driven by
// playwright-core, against the idemq that tests/integration/check_console.c
// started on real servers. It loads every page, checks that a hostile key
// is shown as text, that a POST from another origin, without the form token
// or without the console token is refused, runs a group redrive (dry-run
// confirmation, then the action) and saves screenshots at desktop and phone
// widths. Prints "N passed, N failed"; exits 1 on any failure.
//
// Environment: CONSOLE_URL (http://127.0.0.1:PORT), CONSOLE_TOKEN,
// CONSOLE_GROUP (the group to redrive, of CONSOLE_EXPECT parks),
// CONSOLE_KEY (a key of that group), CONSOLE_SCRIPT_KEY (the hostile key),
// CONSOLE_BIDI_KEY (a parked key holding U+202E, a right-to-left override),
// CONSOLE_LONG_KEY (a parked key of 240 bytes with a long reason),
// CONSOLE_NOKEY_PARK (the id of a park of a message without a key),
// CONSOLE_TOKEN_OTHER (a second token, named "other"),
// CONSOLE_RETRYING_KEY (a job retrying now, after a transient failure),
// CONSOLE_OBSERVE_INPUT (an input with 47 observations in the ledger),
// CONSOLE_LATE_PARK_SQL (parks one more message of CONSOLE_GROUP; run with
// psql on IDEMQ_PG_DSN between a dry run and its action),
// SHOTS_DIR (optional: where the PNGs go).
import { chromium } from 'playwright-core';
import { mkdirSync } from 'node:fs';
import { execFileSync } from 'node:child_process';

const env = (k) => {
  if (!process.env[k]) { console.error(`console.test: ${k} is not set`); process.exit(2); }
  return process.env[k];
};
const URL = env('CONSOLE_URL'), TOKEN = env('CONSOLE_TOKEN'), GROUP = env('CONSOLE_GROUP');
const KEY = env('CONSOLE_KEY'), SCRIPT_KEY = env('CONSOLE_SCRIPT_KEY');
const BIDI_KEY = env('CONSOLE_BIDI_KEY'), LONG_KEY = env('CONSOLE_LONG_KEY');
const NOKEY_PARK = env('CONSOLE_NOKEY_PARK'), TOKEN_OTHER = env('CONSOLE_TOKEN_OTHER');
const RETRYING_KEY = env('CONSOLE_RETRYING_KEY');
const EXPECT = Number(process.env.CONSOLE_EXPECT || '3');
const OBS_INPUT = env('CONSOLE_OBSERVE_INPUT');
const SHOTS = process.env.SHOTS_DIR || '';
const LATE_PARK_SQL = env('CONSOLE_LATE_PARK_SQL'), DSN = env('IDEMQ_PG_DSN');
let passed = 0, failed = 0;
const check = (ok, what) => {
  if (ok) { passed++; console.log(`ok   ${what}`); } else { failed++; console.log(`FAIL ${what}`); }
};

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || '/usr/bin/chromium',
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage',
    // DNS rebinding: an attacker's name that resolves to the console's host
    '--host-resolver-rules=MAP rebind.example 127.0.0.1'],
});
const dialogs = [];
try {
  const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  const page = await ctx.newPage();
  page.on('dialog', async (d) => { dialogs.push(d.message()); await d.dismiss(); });
  page.setDefaultTimeout(15000);
  if (SHOTS) mkdirSync(SHOTS, { recursive: true });
  const pages = [
    ['overview', '/', 'Overview'],
    ['groups', '/groups', 'Failure groups'],
    ['parked', '/parked', 'Parked messages'],
    ['observe', '/observe', 'Observe baseline'],
    ['retrying', '/retrying', 'Retrying now'],
    ['park', '/park?id=' + NOKEY_PARK, 'Park'],
    ['key', '/key?k=' + encodeURIComponent(KEY), 'Key'], // last: the checks below read it
  ];
  for (const [name, path, h1] of pages) {
    const r = await page.goto(URL + path);
    check(r.status() === 200, `GET ${path} answers 200 (${r.status()})`);
    check((await page.textContent('h1')).startsWith(h1), `${path} shows "${h1}"`);
    if (SHOTS) await page.screenshot({ path: `${SHOTS}/${name}-desktop.png`, fullPage: true });
  }
  if (SHOTS) { // phone widths, before the actions change what the pages show
    const phone = await browser.newContext({
      viewport: { width: 390, height: 844 }, deviceScaleFactor: 1, isMobile: true });
    const p = await phone.newPage();
    for (const [name, path] of pages) {
      await p.goto(URL + path);
      await p.screenshot({ path: `${SHOTS}/${name}-phone.png`, fullPage: true });
    }
    await phone.close();
  }
  check((await page.textContent('#key-state')).includes('parked'), 'the key page shows its state');
  check((await page.$$('#timeline tr')).length >= 2 &&
        (await page.textContent('#timeline')).includes('parked #'),
        'the key page shows its story as a timeline, the park included');
  await page.click('#timeline a[href^="/park?id="]');
  check((await page.textContent('#body')).includes('"order": 1001'),
        'a park page shows its body as pretty JSON');
  check((await page.textContent('#headers')).includes('x-idemq') ||
        (await page.textContent('#headers')).length > 0, 'a park page shows its headers');
  check((await page.$$('#attempts tr')).length >= 2, 'a park page lists the key\'s attempts');
  await page.goto(URL + '/retrying');
  check((await page.textContent('#retrying')).includes(RETRYING_KEY) &&
        (await page.textContent('#retrying')).includes('40001'),
        'the retrying view lists a job retrying now, with its error');
  await page.goto(URL + '/park?id=' + NOKEY_PARK);
  check((await page.textContent('#park')).includes('(no key)') &&
        (await page.textContent('#body')).includes('nope'),
        'a park without a key has its page and its body');
  await page.goto(URL + '/observe?input=' + encodeURIComponent(OBS_INPUT));
  const baseline = await page.textContent('#baseline');
  check(baseline.includes(`input ${OBS_INPUT}: 47 deliveries`), 'the observe page shows the baseline');
  check(baseline.includes('would be parked  3  (late replays included: 1)'),
        'the baseline counts what apply mode would park');
  await page.goto(URL + '/');
  check((await page.$$('#plot-throughput svg polyline')).length > 0, 'the overview plots throughput');
  check((await page.textContent('#probe-live')) === 'live', 'the overview shows the live probe');
  await page.goto(URL + '/groups');
  check((await page.textContent('#groups')).includes(GROUP), 'the groups page lists the group');
  await page.goto(URL + '/parked?group=' + GROUP);
  check((await page.textContent('#parked-total')) === `${EXPECT} open parks match`,
        'the parked list filters by group');
  check((await page.$$('#parked tr')).length === EXPECT + 1, 'one row per park');
  await page.goto(URL + '/parked?prefix=' + encodeURIComponent(KEY.slice(0, -1)) + '&reason=REJECTED');
  check((await page.textContent('#parked-total')) === `${EXPECT} open parks match`,
        'the parked list searches by key prefix and reason');
  // long keys and reasons are capped: nothing overflows at 1280 px
  for (const path of ['/groups', '/parked', '/']) {
    await page.goto(URL + path);
    const w = await page.evaluate(() => document.documentElement.scrollWidth);
    check(w <= 1280, `${path}: no horizontal overflow at 1280 px (${w})`);
  }
  await page.goto(URL + '/groups');
  const right = await page.evaluate(() => Math.max(...[...document.querySelectorAll(
    '#groups button')].map((e) => e.getBoundingClientRect().right)));
  check(right <= 1280, `the action buttons stay on screen (${right})`);
  check((await page.textContent('#groups')).includes('\u2026'), 'a long reason is cut with an ellipsis');
  await page.goto(URL + '/parked?group=' + GROUP + '&page=1');
  check((await page.$$('#parked tr')).length === 1 && (await page.$('a[rel=prev]')) !== null,
        'page 2 is empty and links back');

  // The hostile key: text, never markup.
  for (const path of ['/key?k=' + encodeURIComponent(SCRIPT_KEY),
                      '/parked?key=' + encodeURIComponent(SCRIPT_KEY)]) {
    await page.goto(URL + path);
    const scripts = await page.evaluate(() => document.querySelectorAll('script').length);
    check(scripts === 0, `${path.slice(0, 7)}: no <script> element in the DOM`);
    const html = await page.content();
    check(!html.includes('<script>alert(1)</script>'), `${path.slice(0, 7)}: no unescaped tag`);
    check((await page.textContent('body')).includes(SCRIPT_KEY), `${path.slice(0, 7)}: the key shown as text`);
  }
  await page.waitForTimeout(200);
  check(dialogs.length === 0, `no script ran (dialogs: ${dialogs.length})`);

  // The bidi key: its override shown as \u202e, never applied.
  const shown = BIDI_KEY.replace('\u202e', '\\u202e');
  for (const path of ['/parked?key=' + encodeURIComponent(BIDI_KEY), '/groups',
                      '/key?k=' + encodeURIComponent(BIDI_KEY)]) {
    await page.goto(URL + path);
    const text = await page.textContent('main');
    check(!text.includes('\u202e') && text.includes(shown),
          `${path.slice(0, 7)}: the bidi key shown escaped`);
  }

  // DNS rebinding: the browser reaches the console under an attacker's
  // name (same address, same port); the console refuses the Host and
  // shows nothing of the key.
  {
    const rebound = URL.replace('127.0.0.1', 'rebind.example');
    const resp = await page.goto(rebound + '/key?k=' + encodeURIComponent(KEY));
    const text = await page.content();
    check(resp.status() === 421, `a rebinding Host is refused (${resp.status()})`);
    check(!text.includes(KEY), 'the refused page shows nothing of the key');
  }

  // Cross-site and token-less POSTs are refused.
  const req = ctx.request;
  await page.goto(URL + '/groups');
  const csrf = await page.inputValue('#groups input[name=csrf]');
  let r = await req.post(URL + '/confirm', {
    headers: { Origin: 'http://evil.example' }, maxRedirects: 0,
    form: { csrf, action: 'redrive', group: GROUP },
  });
  check(r.status() === 403, `a POST from a foreign Origin is refused (${r.status()})`);
  r = await req.post(URL + '/confirm', {
    headers: { Origin: URL, 'Sec-Fetch-Site': 'cross-site' },
    form: { csrf, action: 'redrive', group: GROUP },
  });
  check(r.status() === 403, `a POST with Sec-Fetch-Site cross-site is refused (${r.status()})`);
  r = await req.post(URL + '/confirm', {
    headers: { Origin: URL }, form: { csrf: '0'.repeat(32), action: 'redrive', group: GROUP },
  });
  check(r.status() === 403, `a POST without a valid form token is refused (${r.status()})`);

  // The confirmation, then the action without the token: refused.
  const openConfirm = async () => {
    await page.goto(URL + '/groups');
    const row = page.locator('#groups tr', { hasText: GROUP });
    await row.locator('button', { hasText: 'redrive' }).click();
    await page.waitForSelector('#dry-count');
  };
  await openConfirm();
  check((await page.textContent('#dry-count')).includes(`${EXPECT} open park`),
        `the dry run counts ${EXPECT} parks`);
  check((await page.textContent('#dry-run')).includes(`would redrive ${EXPECT} messages`),
        'the dry run shows what would move');
  if (SHOTS) {
    await page.screenshot({ path: `${SHOTS}/confirm-desktop.png`, fullPage: true });
  }
  const csrf2 = await page.inputValue('form[action="/act"] input[name=csrf]');
  r = await req.post(URL + '/act', {
    headers: { Origin: URL }, form: { csrf: csrf2, action: 'redrive', group: GROUP },
  });
  check(r.status() === 400, `an action without the token is refused (${r.status()})`);
  r = await req.post(URL + '/act', {
    headers: { Origin: URL }, form: { csrf: csrf2, token: TOKEN, action: 'redrive', group: GROUP },
  });
  check(r.status() === 403, `a dry run's form acts once at most (${r.status()})`);
  // /act with a page's form token (no dry run behind it): refused
  await page.goto(URL + '/groups');
  const pageCsrf = await page.inputValue('#groups input[name=csrf]');
  r = await req.post(URL + '/act', {
    headers: { Origin: URL },
    form: { csrf: pageCsrf, token: TOKEN, action: 'discard', group: GROUP, reason: 'skip' },
  });
  check(r.status() === 403, `an action without a dry run is refused (${r.status()})`);
  await openConfirm();
  await page.fill('input[name=token]', 'not-the-token');
  await page.click('form[action="/act"] button');
  check((await page.textContent('h1')) === 'Refused', 'an action with a wrong token is refused');

  // The group redrive, end to end, on the parks of its dry run only: one
  // more park of the group appears between the dry run and the action.
  await openConfirm();
  execFileSync('psql', ['-X', '-q', '-v', 'ON_ERROR_STOP=1', DSN, '-c', LATE_PARK_SQL]);
  await page.fill('input[name=reason]', 'fixed the limit');
  await page.fill('input[name=token]', TOKEN);
  await page.click('form[action="/act"] button');
  await page.waitForSelector('#act-result');
  check((await page.textContent('#act-result')) === 'done', 'the redrive is done');
  check((await page.textContent('#act-output')).includes(`redrove ${EXPECT} messages`),
        `it redrove ${EXPECT} messages`);
  check((await page.textContent('#act-output')).includes('recorded as operator action'),
        'it is recorded as an operator action');
  check((await page.textContent('#act-actor')).includes('console:browser-test'),
        'the actor is the name of the token given');
  await page.goto(URL + '/parked?group=' + GROUP);
  check((await page.textContent('#parked-total')) === '1 open park match',
        'the park that appeared after the dry run is left for the next one');

  // A discard of the hostile key's group: needs a reason, then recorded.
  await page.goto(URL + '/groups');
  await page.locator('#groups tr', { hasText: SCRIPT_KEY })
    .locator('button', { hasText: 'discard' }).click();
  await page.waitForSelector('#dry-count');
  check((await page.textContent('#dry-count')).includes('1 open park'), 'the discard dry run counts 1 park');
  check((await page.evaluate(() => document.querySelectorAll('script').length)) === 0,
        'the dry run shows the hostile key as text');
  await page.fill('input[name=reason]', 'hostile key');
  await page.fill('input[name=token]', TOKEN);
  await page.click('form[action="/act"] button');
  await page.waitForSelector('#act-result');
  check((await page.textContent('#act-result')) === 'done', 'the discard is done');
  check((await page.textContent('#act-output')).includes('discarded 1 of 1 park'), 'it discarded the park');

  // One message from its page: archive the park without a key.
  await page.goto(URL + '/park?id=' + NOKEY_PARK);
  await page.locator('.actions button', { hasText: 'archive' }).click();
  await page.waitForSelector('#dry-count');
  check((await page.textContent('#dry-count')).includes('1 open park'), 'a park\'s dry run counts 1');
  await page.fill('input[name=reason]', 'no key');
  await page.fill('input[name=token]', TOKEN);
  await page.click('form[action="/act"] button');
  await page.waitForSelector('#act-result');
  check((await page.textContent('#act-result')) === 'done', 'the park is archived');

  // One key from its page, by another token holder: recorded under that name.
  await page.goto(URL + '/key?k=' + encodeURIComponent(BIDI_KEY));
  await page.locator('.actions button', { hasText: 'discard' }).click();
  await page.waitForSelector('#dry-count');
  check((await page.textContent('#dry-count')).includes('1 open park'), 'a key\'s dry run counts 1');
  await page.fill('input[name=reason]', 'bidi key');
  await page.fill('input[name=token]', TOKEN_OTHER);
  await page.click('form[action="/act"] button');
  await page.waitForSelector('#act-result');
  check((await page.textContent('#act-actor')).includes('console:other'), 'the key is discarded by "other"');

} catch (e) {
  failed++;
  console.log(`FAIL ${e.message}`);
} finally {
  await browser.close();
}
console.log(`${passed} passed, ${failed} failed`);
process.exit(failed ? 1 : 0);
