// Drives Debian's headless Chromium with playwright-core (from web/node_modules): loads the page
// through Envoy, lists models over gRPC-Web, streams a generation with EventSource, saves a
// screenshot. Prints one JSON document for the Python test. Usage: node browser_page.mjs URL PNG
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "..", "..", "gateway", "web", "package.json"));
const { chromium } = require("playwright-core");

const [url, screenshot] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"],
});
const result = { console: [], requests: [] };
try {
  const page = await browser.newPage();
  page.on("console", (m) => result.console.push(`${m.type()}: ${m.text()}`));
  page.on("request", (r) => result.requests.push(`${r.method()} ${r.headers()["content-type"] || ""} ${r.url()}`));
  await page.goto(url, { waitUntil: "load" });
  await page.waitForSelector("#models[data-state=loaded] li.model", { timeout: 30000 });
  result.models = await page.$$eval("#models li.model", (items) => items.map((i) => i.dataset.name));
  await page.fill("#prompt", "def fibonacci(n):");
  await page.fill("#max-tokens", "40");
  const started = Date.now();
  await page.click("button[type=submit]");
  await page.waitForSelector("#status[data-state=done], #status[data-state=error]", { timeout: 60000 });
  result.ms = Date.now() - started;
  result.status = await page.$eval("#status", (s) => `${s.dataset.state} ${s.textContent}`);
  result.output = await page.$eval("#output", (o) => o.textContent);
  result.token_events = await page.$eval("#output", (o) => Number(o.dataset.events));
  result.version = await page.$eval("#version", (o) => o.textContent);
  result.dye = await page.$eval("#dye", (o) => o.textContent);
  await page.screenshot({ path: screenshot, fullPage: true });
} finally {
  await browser.close();
}
console.log(JSON.stringify(result));
