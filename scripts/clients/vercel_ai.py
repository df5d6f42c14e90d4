"""The Vercel AI SDK (`ai` with `@ai-sdk/openai`, Chat Completions) on Node: `generateText` with a tool that
has `execute`, up to 3 steps (`stopWhen: stepCountIs(3)`): the SDK runs the tool and sends its result back."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from typing import Any

from _common import MODEL, OPENAI_TOOL, QUESTION, SYSTEM, result

LABEL = "Vercel AI SDK (`ai`, npm, Node)"
LANGUAGE = "node"
MODES = "generateText with an executed tool, chat.completions, 3 steps at most"
NPM = ["ai@7.0.173", "@ai-sdk/openai@4.0.118"]

SCRIPT = r"""
import { generateText, jsonSchema, stepCountIs, tool } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { readFileSync } from "node:fs";
const [baseURL, apiKey, model, system, question, toolJson] = process.argv.slice(2);
const v = (p) => JSON.parse(readFileSync(new URL(`./node_modules/${p}/package.json`, import.meta.url))).version;
const version = `ai ${v("ai")}, @ai-sdk/openai ${v("@ai-sdk/openai")}, node ${process.version}`;
function calculate(e) {  // as the Python drivers' tool: a + b, a - b or a * b of two integers
  const m = /^\s*(\d+)\s*([-+*])\s*(\d+)\s*$/.exec(String(e));
  if (!m) return "error: unsupported expression";
  const [x, y] = [Number(m[1]), Number(m[3])];
  return String(m[2] === "+" ? x + y : m[2] === "-" ? x - y : x * y);
}
const fn = JSON.parse(toolJson).function;
const provider = createOpenAI({ baseURL, apiKey });
const out = await generateText({
  model: provider.chat(model), system, prompt: question, maxOutputTokens: 128, temperature: 0, maxRetries: 0,
  tools: { calculate: tool({ description: fn.description, inputSchema: jsonSchema(fn.parameters),
                             execute: async ({ expression }) => calculate(expression) }) },
  stopWhen: stepCountIs(3),
});
console.log(JSON.stringify({ ok: true, version, calls: out.steps.length,
  detail: `${out.steps.length} steps, tool calls ${JSON.stringify(out.steps.flatMap((s) => s.toolCalls.map((c) => c.input)))}, text ${JSON.stringify(out.text)}` }));
"""


def run(base_url: str, api_key: str, workdir: pathlib.Path) -> dict[str, Any]:
    link = workdir / "node_modules"
    if not link.exists():
        link.symlink_to(pathlib.Path(os.environ["ROLLWAY_NODE_MODULES"]), target_is_directory=True)
    (workdir / "driver.mjs").write_text(SCRIPT)
    proc = subprocess.run(["node", "driver.mjs", base_url, api_key, MODEL, SYSTEM,
                           QUESTION, json.dumps(OPENAI_TOOL)], cwd=workdir, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return result(False, f"node exited {proc.returncode}: {proc.stderr[-400:]}", "?")
    out = json.loads(lines[-1])
    return result(bool(out["ok"]), out["detail"], out.get("version", "?"), int(out.get("calls", 0)))
