"""The arithmetic task, answered through a streamed chat completion (text arrives chunk by chunk).

Task: {"prompt": "37+48=", "answer": "85"}; exact-match reward on the concatenated stream.
"""

from openai import AsyncOpenAI


async def run(task: dict, client: AsyncOpenAI) -> float:
    stream = await client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return 1.0 if "".join(parts).strip() == task["answer"] else 0.0
