"""An agent that owns its tools, written as the openai SDK's function-calling guide writes one: it offers the policy
a calculator (``tools=``), runs each of the policy's ``message.tool_calls`` itself and answers with
``{"role": "tool", "tool_call_id", "content"}`` messages, until a reply without calls (the answer). Nothing in it is
hybridrl's: ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY`` come from the environment, the task from ``HYBRIDRL_TASK``.

Used by ``recipes/recipe/grpo_agent_tools_tiny.yaml`` (the reward there is ``arithmetic``, read from the policy's
last turn, so this agent prints none); its ``tools`` there are :data:`TOOLS`, which the chat template renders into
the prompts.
"""

import ast
import json
import operator
import os

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an integer arithmetic expression: + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "e.g. 12*(3+4)"}}, "required": ["expression"]}}}]
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
             ast.Div: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and not 0 <= right <= 64:
            raise ValueError(f"exponent {right} outside 0..64")
        return OPERATORS[type(node.op)](left, right)
    raise ValueError(f"not integer arithmetic: {ast.unparse(node)}")


def calculator(expression: str) -> str:
    try:
        return str(evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"


client = OpenAI()
messages = json.loads(os.environ["HYBRIDRL_TASK"])
while True:
    message = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS).choices[0].message
    messages.append(message)
    if not message.tool_calls:
        break  # the answer
    for call in message.tool_calls:
        try:
            result = calculator(**json.loads(call.function.arguments))
        except (TypeError, ValueError) as e:  # arguments that are not {"expression": "..."}
            result = f"Error: {e}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
