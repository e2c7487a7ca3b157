// Drives Debian's headless Chromium with playwright-core (from gateway/web/node_modules) for
// tests/edge/browser/test_browser.py. Prints JSON lines: progress marks ({"mark": ...}, the test acts on
// some of them) and, last, one result document. Usage: node browser_page.mjs MODE URL ARTIFACTS [MODEL]
//   page       the page through Envoy at 1280 and 390 px: models, labels, a generation, the
//              server's refusals, stop (button and Esc), keyboard use, screenshots
//   close-tab  a generation with MODEL, then the tab is closed mid-stream (mark "closed")
//   crash      the page on the gateway's own port: the models note; mark "streaming" once tokens
//              come (the test kills the service then), then the error as the page words it
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "..", "..", "..", "gateway", "web", "package.json"));
const { chromium } = require("playwright-core");

const [mode, url, artifacts, model] = process.argv.slice(2);
const WIDE = { width: 1280, height: 900 };
const PHONE = { width: 390, height: 844 };
const mark = (name, extra = {}) => console.log(JSON.stringify({ mark: name, ...extra }));

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"],
});
const result = { mode, console: [], requests: [], failed_responses: [] };

async function open(viewport) {
  const page = await browser.newPage({ viewport });
  page.on("console", (m) => result.console.push(`${m.type()}: ${m.text()}`));
  page.on("request", (r) => result.requests.push(`${r.method()} ${r.headers()["content-type"] || ""} ${r.url()}`));
  page.on("response", (r) => {
    if (r.status() >= 400) result.failed_responses.push(`${r.status()} ${r.url()}`);
  });
  await page.goto(url, { waitUntil: "load" });
  return page;
}

// Resolves as soon as the page has shown `n` token events (a MutationObserver: no polling, so
// the test acts within milliseconds, well before a 256-token generation ends).
const whenEvents = (page, n) =>
  page.evaluate(
    (n) =>
      new Promise((resolve) => {
        const output = document.getElementById("output");
        const observer = new MutationObserver(() => check());
        const check = () => {
          if (Number(output.dataset.events || 0) >= n) {
            observer.disconnect();
            resolve();
          }
        };
        observer.observe(output, { attributes: true, attributeFilter: ["data-events"] });
        check();
      }),
    n,
  );
// The moment the page has shown `n` token events, in the page itself: "stop" clicks Stop; "keys"
// presses Ctrl+Enter in the prompt (a second generation, which must not replace this one), then
// Esc. Returns what the page showed then.
const onEvents = (page, n, act) =>
  page.evaluate(
    ([n, act]) =>
      new Promise((resolve) => {
        const $ = (id) => document.getElementById(id);
        const output = $("output");
        const observer = new MutationObserver(() => check());
        const check = () => {
          if (Number(output.dataset.events || 0) < n) return;
          observer.disconnect();
          const seen = {
            events: Number(output.dataset.events),
            text: output.textContent,
            state: $("status").dataset.state,
            generate_disabled: $("generate").disabled,
            stop_disabled: $("stop").disabled,
          };
          if (act === "stop") $("stop").click();
          if (act === "keys") {
            const key = (init) => new KeyboardEvent("keydown", { bubbles: true, cancelable: true, ...init });
            $("prompt").dispatchEvent(key({ key: "Enter", ctrlKey: true }));
            seen.after_second = output.textContent;
            seen.state_after_second = $("status").dataset.state;
            $("prompt").dispatchEvent(key({ key: "Escape" }));
          }
          resolve(seen);
        };
        observer.observe(output, { attributes: true, attributeFilter: ["data-events"] });
        check();
      }),
    [n, act],
  );
const events = (page) => page.$eval("#output", (o) => Number(o.dataset.events || 0));
const status = (page) => page.$eval("#status", (s) => ({ state: s.dataset.state, text: s.textContent }));
const settled = (page, timeout = 60000) =>
  page.waitForSelector("#status[data-state=done], #status[data-state=error], #status[data-state=stopped]", {
    timeout,
  });
const noHorizontalScroll = (page) =>
  page.evaluate(() => {
    const root = document.documentElement;
    return { scroll: root.scrollWidth, client: root.clientWidth, ok: root.scrollWidth <= root.clientWidth };
  });

async function run(page, { prompt, maxTokens = "40", model } = {}) {
  if (prompt !== undefined) await page.fill("#prompt", prompt);
  await page.fill("#max-tokens", maxTokens);
  if (model) {
    // A model the box does not offer (it lists decoders only): as a stale page would send it.
    await page.$eval("#model", (s, name) => {
      const option = document.createElement("option");
      option.value = option.textContent = name;
      s.append(option);
      s.value = name;
    }, model);
  }
  await page.click("#generate");
  await settled(page);
  return status(page);
}

async function pageMode() {
  const page = await open(WIDE);
  await page.waitForSelector("#models[data-state=loaded] li.model", { timeout: 30000 });
  result.models = await page.$$eval("#models li.model", (items) => items.map((i) => i.dataset.name));
  result.offered = await page.$$eval("#model option", (options) => options.map((o) => o.value));
  result.a11y = await page.evaluate(() => ({
    unlabelled: [...document.querySelectorAll("input, select, textarea")]
      .filter((e) => !e.labels || e.labels.length === 0)
      .map((e) => e.id),
    status_live: document.getElementById("status").getAttribute("aria-live"),
    status_role: document.getElementById("status").getAttribute("role"),
    icon: document.querySelector("link[rel=icon]")?.getAttribute("href"),
  }));
  result.favicon = await page.evaluate(async () => {
    const r = await fetch("/favicon.ico");
    return { status: r.status, type: r.headers.get("content-type"), bytes: (await r.arrayBuffer()).byteLength };
  });

  // A generation, by mouse.
  await page.fill("#prompt", "def fibonacci(n):");
  result.done = await run(page, { maxTokens: "40" });
  result.output = await page.$eval("#output", (o) => o.textContent);
  result.token_events = await events(page);
  result.version = await page.$eval("#version", (o) => o.textContent);
  result.dye = await page.$eval("#dye", (o) => o.textContent);
  result.wide_scroll = await noHorizontalScroll(page);
  await page.screenshot({ path: path.join(artifacts, "page-1280.png"), fullPage: true });

  // The server's refusals, in its words.
  result.errors = {
    prompt: await run(page, { prompt: "" }),
    max_tokens: await run(page, { prompt: "def f():", maxTokens: "100000" }),
    decoder: await run(page, { prompt: "def f():", model: "classifier" }),
  };
  await page.screenshot({ path: path.join(artifacts, "page-1280-error.png"), fullPage: true });
  await page.selectOption("#model", "codelm");

  // Stop, by the button: the stream ends and nothing more arrives. The click comes from inside
  // the page the moment the third token shows (a fast model could finish before a click sent
  // from here arrives).
  await page.fill("#prompt", "def main():");
  await page.fill("#max-tokens", "256");
  await page.click("#generate");
  result.during = await onEvents(page, 3, "stop");
  await settled(page, 10000);
  const atStop = await events(page);
  await page.waitForTimeout(1500); // a window in which nothing may arrive
  result.stop = { ...(await status(page)), at_stop: atStop, after: await events(page) };
  mark("stopped");

  // The keyboard: Ctrl+Enter in the prompt starts (a real key press); at the third token a second
  // Ctrl+Enter does not replace the running generation, and Esc stops it (keys sent in the page,
  // for the same reason as the click above).
  await page.focus("#prompt");
  await page.keyboard.press("Control+Enter");
  const keys = await onEvents(page, 3, "keys");
  await settled(page, 10000);
  result.keyboard = {
    kept: keys.after_second.startsWith(keys.text),
    running: keys.state_after_second,
    ...(await status(page)),
  };
  await page.close();

  // A phone: one column, no horizontal scroll with a long prompt, text and error.
  const phone = await open(PHONE);
  await phone.waitForSelector("#models[data-state=loaded] li.model", { timeout: 30000 });
  phone.setDefaultTimeout(60000);
  result.phone_done = await run(phone, { prompt: "def fibonacci(n):", maxTokens: "64" });
  result.phone_scroll = await noHorizontalScroll(phone);
  result.phone_columns = await phone.evaluate(() => {
    const [a, b] = [document.querySelector("main > section"), document.querySelector("main > aside")];
    return { stacked: b.getBoundingClientRect().top >= a.getBoundingClientRect().bottom - 1 };
  });
  await phone.screenshot({ path: path.join(artifacts, "page-390.png"), fullPage: true });
  result.phone_error = await run(phone, { prompt: "x".repeat(400), maxTokens: "100000" });
  result.phone_error_scroll = await noHorizontalScroll(phone);
  await phone.screenshot({ path: path.join(artifacts, "page-390-error.png"), fullPage: true });
  await phone.close();
}

async function closeTabMode() {
  const page = await open(WIDE);
  await page.waitForSelector("#models[data-state=loaded] li.model", { timeout: 30000 });
  await page.selectOption("#model", model);
  await page.fill("#prompt", "def main():");
  await page.fill("#max-tokens", "256");
  // The stream's 200 comes with its first token (the gateway waits for it): the browser process
  // reports it before the page's script has run, so the tab closes as early as it can, before a
  // fast model ends, its connection with it.
  const opened = page.waitForResponse((r) => r.url().endsWith("/generate") && r.request().method() === "POST");
  await page.click("#generate");
  result.status_code = (await opened).status();
  await page.close();
  mark("closed");
}

async function crashMode() {
  const page = await open(PHONE);
  await page.waitForSelector("#models[data-state=error]", { state: "attached", timeout: 30000 });
  result.models_note = await page.$eval("#models-note", (n) => n.textContent);
  await page.fill("#prompt", "def main():");
  await page.fill("#max-tokens", "256");
  await page.click("#generate");
  await whenEvents(page, 2);
  mark("streaming");
  await settled(page, 60000);
  result.crash = await status(page);
  result.crash_scroll = await noHorizontalScroll(page);
  await page.screenshot({ path: path.join(artifacts, "page-390-crash.png"), fullPage: true });
}

try {
  await { page: pageMode, "close-tab": closeTabMode, crash: crashMode }[mode]();
} finally {
  await browser.close();
}
console.log(JSON.stringify(result));
