"""The `@anthropic-ai/sdk` npm package on Node: Messages with a tool, streamed (`messages.stream`, the final
message sent back as is), tool_use then tool_result then the answer."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

from _common import MODEL, OPENAI_TOOL, QUESTION, SYSTEM, result

LABEL = "`@anthropic-ai/sdk` (npm, Node)"
LANGUAGE = "node"
MODES = "messages.stream: tool_use and tool_result"
NPM = ["@anthropic-ai/sdk@1.14.0"]

SCRIPT = r"""
import Anthropic from "@anthropic-ai/sdk";
import { readFileSync } from "node:fs";
const [baseURL, apiKey, model, system, question, tool] = process.argv.slice(2);
const pkg = JSON.parse(readFileSync(new URL("./node_modules/@anthropic-ai/sdk/package.json", import.meta.url)));
const version = `@anthropic-ai/sdk ${pkg.version}, node ${process.version}`;
function calculate(e) {  // as the Python drivers' tool: a + b, a - b or a * b of two integers
  const m = /^\s*(\d+)\s*([-+*])\s*(\d+)\s*$/.exec(String(e));
  if (!m) return "error: unsupported expression";
  const [x, y] = [Number(m[1]), Number(m[3])];
  return String(m[2] === "+" ? x + y : m[2] === "-" ? x - y : x * y);
}
const client = new Anthropic({ baseURL, apiKey, maxRetries: 0, timeout: 300000 });
const fn = JSON.parse(tool).function;
const tools = [{ name: fn.name, description: fn.description, input_schema: fn.parameters }];
const messages = [{ role: "user", content: question }];
const first = await client.messages.stream({ model, max_tokens: 128, system, tools, messages }).finalMessage();
const uses = first.content.filter((b) => b.type === "tool_use");
if (!uses.length) { console.log(JSON.stringify({ ok: false, version, detail: `the model called no tool: ${JSON.stringify(first.content)}` })); process.exit(0); }
messages.push({ role: "assistant", content: first.content });
messages.push({ role: "user", content: uses.map((u) => ({ type: "tool_result", tool_use_id: u.id, content: calculate(u.input.expression) })) });
const second = await client.messages.create({ model, max_tokens: 128, system, tools, messages });
console.log(JSON.stringify({ ok: true, version,
  detail: `called ${JSON.stringify(uses.map((u) => u.input))}, then answered ${JSON.stringify(second.content)}` }));
"""


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    link = workdir / "node_modules"
    if not link.exists():
        link.symlink_to(pathlib.Path(os.environ["ROLLWAY_NODE_MODULES"]), target_is_directory=True)
    (workdir / "driver.mjs").write_text(SCRIPT)
    proc = subprocess.run(["node", "driver.mjs", os.environ["ROLLWAY_ANTHROPIC_BASE_URL"], api_key, MODEL, SYSTEM,
                           QUESTION, json.dumps(OPENAI_TOOL)], cwd=workdir, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return result(False, f"node exited {proc.returncode}: {proc.stderr[-400:]}", "?")
    out = json.loads(lines[-1])
    return result(bool(out["ok"]), out["detail"], out.get("version", "?"), 2 if out["ok"] else 1, 1)
