"""A Griffe extension (mkdocs.yml): document a public function that a factory builds as a function.

Griffe reads the source, so ``size = _topology_field("size", "...")`` or
``allreduce = _impl.allreduce_function(__name__, average_default=True)`` would be an attribute
without a docstring, left out of the API reference. For such an assignment of a name in the
module's ``__all__``, this extension imports the module and, where the value is a function,
documents it with its runtime signature and docstring. Where the module cannot be imported (a
framework the docs environment lacks), the name is left out as before, without a warning.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import griffe


def _default_texts(fn: Any) -> dict[str, str]:
    """Each default as written in ``fn``'s source; a variable of the factory, as its value."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
        return {}
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.FunctionDef):
        return {}
    args = node.args
    positional = args.posonlyargs + args.args
    pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults, strict=True))
    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
    factory_vars = set(fn.__code__.co_freevars)
    return {a.arg: (repr(inspect.signature(fn).parameters[a.arg].default)
                    if isinstance(d, ast.Name) and d.id in factory_vars
                    else ast.get_source_segment(source, d) or "")
            for a, d in pairs}


def _parameters(fn: Any) -> griffe.Parameters:
    texts = _default_texts(fn)
    params = []
    for p in inspect.signature(fn).parameters.values():
        params.append(griffe.Parameter(
            p.name, kind=griffe.ParameterKind(p.kind.description),
            annotation=None if p.annotation is p.empty else str(p.annotation),
            default=None if p.default is p.empty else texts.get(p.name, repr(p.default))))
    return griffe.Parameters(*params)


class BuiltFunctions(griffe.Extension):
    """Replace a module attribute assigned from a call by the function it holds at run time."""

    def on_attribute_instance(self, *, node: ast.AST | griffe.ObjectNode, attr: griffe.Attribute,
                              agent: griffe.Visitor | griffe.Inspector, **kwargs: Any) -> None:
        if not (isinstance(agent, griffe.Visitor) and isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call) and attr.parent is not None and attr.parent.is_module
                and attr.name in {str(name) for name in attr.parent.exports or ()}):
            return
        try:
            fn = griffe.dynamic_import(attr.path)
        except Exception:  # noqa: BLE001 - the module needs what this environment lacks
            return
        if not inspect.isfunction(fn) or fn.__name__ != attr.name or not fn.__doc__:
            return
        returns = inspect.signature(fn).return_annotation
        docstring = griffe.Docstring(inspect.cleandoc(fn.__doc__), lineno=attr.lineno,
                                     parser=agent.docstring_parser, parser_options=agent.docstring_options)
        built = griffe.Function(attr.name, lineno=attr.lineno, endlineno=attr.endlineno,
                                parameters=_parameters(fn), docstring=docstring,
                                returns=None if returns is inspect.Signature.empty else str(returns))
        attr.parent.set_member(attr.name, built)
