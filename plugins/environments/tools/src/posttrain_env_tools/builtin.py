"""The built-in tools: a calculator and a Python interpreter in the code sandbox."""

from __future__ import annotations

import ast
import operator

#: Operators the calculator evaluates.
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
#: The largest exponent the calculator takes (a bigger power would take minutes and gigabytes).
MAX_EXPONENT = 1000


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 30) * 2"
    """
    tree = ast.parse(expression.strip(), mode="eval")
    value = _evaluate(tree.body)
    return str(int(value) if isinstance(value, float) and value.is_integer() and abs(value) < 2**53 else value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
        return _BINARY[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not arithmetic: {ast.unparse(node)!r}")


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    Args:
        code: the program; print what you want to see
    """
    from posttrain_env_code.sandbox import Sandbox, SandboxLimits

    result = Sandbox(SandboxLimits(timeout_s=5.0)).run(code)
    if result.timed_out:
        return "error: the program did not finish within 5 s"
    if result.exit_code != 0:
        return f"error: {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f'exit code {result.exit_code}'}"
    return result.stdout
