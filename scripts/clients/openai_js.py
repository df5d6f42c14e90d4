"""The `openai` npm package on Node: Chat Completions with a function tool, the first step streamed, the tool's
result sent back, the second not streamed (the same task as openai_python)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

from _common import MODEL, OPENAI_TOOL, QUESTION, SYSTEM, result

LABEL = "`openai` (npm, Node)"
LANGUAGE = "node"
MODES = "chat.completions: function tool, streamed and not"
NPM = ["openai@7.57.0"]

SCRIPT = r"""
import OpenAI from "openai";
import { readFileSync } from "node:fs";
const [baseURL, apiKey, model, system, question, tool] = process.argv.slice(2);
function calculate(e) {  // as the Python drivers' tool: a + b, a - b or a * b of two integers
  const m = /^\s*(\d+)\s*([-+*])\s*(\d+)\s*$/.exec(String(e));
  if (!m) return "error: unsupported expression";
  const [x, y] = [Number(m[1]), Number(m[3])];
  return String(m[2] === "+" ? x + y : m[2] === "-" ? x - y : x * y);
}
const pkg = JSON.parse(readFileSync(new URL("./node_modules/openai/package.json", import.meta.url)));
const version = `openai ${pkg.version}, node ${process.version}`;
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0, timeout: 300000 });
const messages = [{ role: "system", content: system }, { role: "user", content: question }];
const tools = [JSON.parse(tool)];
const stream = await client.chat.completions.create({ model, messages, tools, max_tokens: 128, temperature: 0, stream: true });
let content = "";
const calls = {};
for await (const chunk of stream) {
  const delta = chunk.choices[0]?.delta;
  if (!delta) continue;
  content += delta.content ?? "";
  for (const tc of delta.tool_calls ?? []) {
    const c = (calls[tc.index] ??= { id: "", name: "", arguments: "" });
    c.id = tc.id ?? c.id; c.name += tc.function?.name ?? ""; c.arguments += tc.function?.arguments ?? "";
  }
}
const list = Object.values(calls);
if (!list.length) { console.log(JSON.stringify({ ok: false, version, detail: `the model called no tool: ${JSON.stringify(content)}` })); process.exit(0); }
messages.push({ role: "assistant", content: content || null,
  tool_calls: list.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } })) });
for (const c of list) messages.push({ role: "tool", tool_call_id: c.id, content: calculate(JSON.parse(c.arguments).expression) });
const second = await client.chat.completions.create({ model, messages, tools, max_tokens: 128, temperature: 0 });
console.log(JSON.stringify({ ok: true, version,
  detail: `called ${JSON.stringify(list.map((c) => c.arguments))}, then answered ${JSON.stringify(second.choices[0].message.content)}` }));
"""


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    modules = pathlib.Path(os.environ["ROLLWAY_NODE_MODULES"])
    link = workdir / "node_modules"
    if not link.exists():
        link.symlink_to(modules, target_is_directory=True)
    (workdir / "driver.mjs").write_text(SCRIPT)
    proc = subprocess.run(["node", "driver.mjs", base_url, api_key, MODEL, SYSTEM, QUESTION, json.dumps(OPENAI_TOOL)], cwd=workdir, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return result(False, f"node exited {proc.returncode}: {proc.stderr[-400:]}", "?")
    out = json.loads(lines[-1])
    return result(bool(out["ok"]), out["detail"], out.get("version", "?"), 2 if out["ok"] else 1, 1)
