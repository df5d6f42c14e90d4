"""Calculator tool use: multi-turn OpenAI function calling, reward from the final answer.

The model may call `calculate(expression)` any number of times (up to MAX_TURNS replies); the tool's
result goes back as a `tool` message; the final text reply is compared with the answer.
Task: {"question": "What is 12*7?", "answer": "84"}.
"""

import ast
import json
import operator

from openai import AsyncOpenAI

MAX_TURNS = 4
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. 12*(3+4)"}},
            "required": ["expression"],
        },
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError("unsupported expression")


def calculate(expression: str) -> str:
    try:
        value = _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


async def run(task: dict, client: AsyncOpenAI) -> float:
    messages = [
        {"role": "system", "content": "Use the calculate tool, then answer with the number only."},
        {"role": "user", "content": task["question"]},
    ]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, max_tokens=64,
        )
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            return 1.0 if (msg.content or "").strip() == task["answer"] else 0.0
        for call in msg.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(str(expression))})
    return 0.0
