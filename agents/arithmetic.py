"""Arithmetic solver: one turn, exact-match reward. Imports only the OpenAI SDK and the standard library.

Task: {"prompt": "37+48=", "answer": "85"}. Reward 1.0 when the reply, stripped, equals the answer.
Run it: rollway rollout --agent agents/arithmetic.py --tasks agents/tasks/arithmetic.jsonl --n-samples 8
"""

from openai import AsyncOpenAI


async def run(task: dict, client: AsyncOpenAI) -> float:
    reply = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=8,
        temperature=0.0,  # the group's sampling policy overrides this for training groups
    )
    answer = (reply.choices[0].message.content or "").strip()
    return 1.0 if answer == task["answer"] else 0.0
