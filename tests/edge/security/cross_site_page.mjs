// For tests/edge/security/test_default_edge.py: opens PAGE (another site's page, served by the test)
// in Debian's headless Chromium with playwright-core (from gateway/web/node_modules) and prints
// one JSON line: what the page's fetch() calls came to, and the requests the page made.
// Usage: node cross_site_page.mjs PAGE
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import path from "node:path";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, "..", "..", "..", "gateway", "web", "package.json"));
const { chromium } = require("playwright-core");

const [pageUrl] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"],
});
try {
  const page = await browser.newPage();
  const sent = [];
  page.on("request", (r) => sent.push(r.allHeaders().then((headers) => ({ method: r.method(), url: r.url(), headers }))));
  await page.goto(pageUrl, { waitUntil: "load" });
  const outcomes = await page.evaluate(() => window.done);
  console.log(JSON.stringify({ outcomes, requests: await Promise.all(sent) }));
} finally {
  await browser.close();
}
