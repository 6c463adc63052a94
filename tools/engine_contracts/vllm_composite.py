"""vLLM's composite attention backends (0.30+): one backend built by
``create_composite_attention_backend(general, causal, ...)`` over two others that share one KV
cache, e.g. ``TRITON_FLASH_ATTN`` (Triton for image-prefix masks, FlashAttention for causal
queries; SM90) and ``TRITON_FLASHINFER`` (Triton and FlashInfer; SM100), which the CUDA platform
puts first for models with bidirectional image prefixes (``is_mm_prefix_lm``).

Each composite is recorded like a plain backend (``name``, ``get_kv_cache_shape``, ``impl``,
``kv_read``, ``registered_tensor``) plus ``composite``: its two children, the factory's options,
what the factory's generated classes do with the cache, and where the platform selects it. Its
``kv_read`` lists its children's reads (the generated implementation hands ``kv_cache`` unchanged
to the child chosen per batch, and writes through the general child), each tagged with the child.
"""

from __future__ import annotations

import ast
from typing import Any

from .sources import FuncDef, Sources, enclosing_qualname, enclosing_tests, find_def, src
from .vllm_paths import BACKENDS_DIR

FACTORY = "create_composite_attention_backend"
FACTORY_FILE = BACKENDS_DIR + "composite.py"
PLATFORM_FILES = ("vllm/platforms/cuda.py",)
MM_PREFIX_FILE = "vllm/transformers_utils/model_arch_config_convertor.py"
#: Composite names looked for in every release (``null`` where a release has none).
KNOWN = ("TRITON_FLASH_ATTN", "TRITON_FLASHINFER")


def _factory_calls(tree: ast.Module) -> list[tuple[str, ast.Call]]:
    """``Name = create_composite_attention_backend(...)`` at module level."""
    out = []
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func).split(".")[-1] == FACTORY
        ):
            out.append((ast.unparse(node.targets[0]), node.value))
    return out


def _child(tree: ast.Module, name: str, keys_by_module: dict[str, str]) -> dict[str, Any]:
    """The backend a factory argument names: a class imported from a backend module, or a
    subclass of one defined in the composite's own file (followed to its base)."""
    entry: dict[str, Any] = {"class": name}
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if cls is not None and cls.bases:
        base = ast.unparse(cls.bases[0]).split(".")[-1]
        entry["subclass_of"] = base
        entry["overrides"] = sorted(f.name for f in cls.body if isinstance(f, FuncDef))
        name = base
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == name for a in node.names):
            entry["backend"] = keys_by_module.get(node.module or "")
    return entry


def _generated(s: Sources) -> dict[str, Any] | None:
    """What the factory's generated backend and implementation do with the cache."""
    tree = s.tree(FACTORY_FILE)
    factory = find_def(tree, FACTORY)
    if factory is None:
        return None
    classes = {n.name: n for n in ast.walk(factory) if isinstance(n, ast.ClassDef)}
    backend = classes.get("CompositeAttentionBackend")
    impl = classes.get("CompositeAttentionImpl")
    if backend is None or impl is None:
        return None
    methods = {f.name: f for f in backend.body if isinstance(f, FuncDef)}
    impl_methods = {f.name: f for f in impl.body if isinstance(f, FuncDef)}

    def body(fn: ast.AST | None) -> list[str] | None:
        return None if fn is None else [ast.unparse(st) for st in fn.body]  # type: ignore

    forward = impl_methods.get("forward")
    passes = []
    for node in ast.walk(forward) if forward is not None else []:
        if isinstance(node, ast.Call) and any(
            isinstance(a, ast.Name) and a.id == "kv_cache" for a in node.args
        ):
            passes.append(ast.unparse(node))
    qual = f"{FACTORY}.<locals>"
    return {
        "source": src(FACTORY_FILE, FACTORY),
        "get_name": body(methods.get("get_name")),
        "defines": sorted(m for m in methods if m.startswith("get_kv_cache")),
        "supported_kv_cache_layouts": body(methods.get("supported_kv_cache_layouts")),
        "customize_spec": body(methods.get("customize_spec")),
        "impl": "CompositeAttentionImpl",
        "impl_forward_passes_kv_cache": passes,
        "impl_get_impl_for_metadata": body(impl_methods.get("get_impl_for_metadata")),
        "impl_do_kv_cache_update": body(impl_methods.get("do_kv_cache_update")),
        "impl_source": src(FACTORY_FILE, f"{qual}.CompositeAttentionImpl"),
    }


def _selected(s: Sources, name: str) -> list[dict[str, Any]]:
    """Where a platform lists ``AttentionBackendEnum.<name>``, with the tests around it (an
    enclosing ``if`` and the ``x if test else []`` the name sits in)."""
    out = []
    for path in PLATFORM_FILES:
        tree = s.tree(path)
        if tree is None:
            continue
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr == name):
                continue
            tests = []
            up = parents.get(node)
            while up is not None and not isinstance(up, ast.stmt):
                if isinstance(up, ast.IfExp):
                    tests.append(ast.unparse(up.test))
                up = parents.get(up)
            qual = enclosing_qualname(tree, node)
            fn = find_def(tree, qual)
            stmt_tests = enclosing_tests(fn, node) if fn is not None else []
            out.append({"when": [*stmt_tests, *tests] or None, "source": src(path, qual)})
    return out


def _mm_prefix_model_types(s: Sources) -> dict[str, Any] | None:
    tree = s.tree(MM_PREFIX_FILE)
    for node in ast.walk(tree) if tree is not None else []:
        if (
            isinstance(node, ast.Assign)
            and ast.unparse(node.targets[0]) == "MM_PREFIX_LM_MODELS"
            and isinstance(node.value, ast.Tuple)
        ):
            return {
                "values": [e.value for e in node.value.elts],  # type: ignore[attr-defined]
                "source": src(MM_PREFIX_FILE, enclosing_qualname(tree, node)),
            }
    return None


def _default_layouts(children: list[dict], enum_order: list[str], pref: list[str]) -> list:
    """``get_supported_kv_cache_layouts((general, causal))[0]`` for each pair of the children's
    ``supported_kv_cache_layouts`` returns: the declared lists (``None``: no preference; none
    declared: the default preference); identical ones keep their order, else the layout most
    lists put first among those all support, ties in enum order."""
    options = [
        (c.get("supported_kv_cache_layouts") or {}).get("returns") or [{"value": None}]
        for c in children
    ]
    out = []
    for first in options[0]:
        for second in options[1]:
            lists = [r["value"] for r in (first, second) if isinstance(r.get("value"), list)]
            lists = lists or [pref]
            if all(lst == lists[0] for lst in lists):
                layout = lists[0][0]
            else:
                common = set.intersection(*map(set, lists))
                firsts = [lst[0] for lst in lists]
                ranked = sorted(
                    (m for m in enum_order if m in common), key=firsts.count, reverse=True
                )
                layout = ranked[0] if ranked else None
            whens = [r.get("when") for r in (first, second) if r.get("when")]
            out.append({"layout": layout, "when": " and ".join(whens) or None})
    return [dict(t) for t in dict.fromkeys(tuple(sorted(d.items())) for d in out)]


def composite_backends(
    s: Sources, backends: dict[str, Any], layout: dict[str, Any], backend_files: dict[str, str]
) -> dict[str, Any]:
    """Every composite backend of the release by its ``get_name()``, and ``None`` for each of
    :data:`KNOWN` it lacks. ``backends``: the plain backends already recorded."""
    keys_by_module = {
        (BACKENDS_DIR + f).removesuffix(".py").replace("/", "."): k
        for k, f in backend_files.items()
    }
    generated = _generated(s)
    enum = (layout.get("enum") or {}).get("members", {})
    pref = layout.get("default_preference") or []
    out: dict[str, Any] = {k: None for k in KNOWN}
    for path in s.glob(BACKENDS_DIR):
        tree = s.tree(path)
        for cls_name, call in _factory_calls(tree) if tree is not None else []:
            opts = {
                k.arg: ast.unparse(k.value)
                for k in call.keywords
                if k.arg not in (None, "name", "module")  # the class's own name and module
            }
            name = opts.pop("backend_name", "").strip("'\"")
            general, causal = (_child(tree, ast.unparse(a), keys_by_module) for a in call.args)
            kids = [backends.get(c.get("backend") or "") or {} for c in (general, causal)]
            reads = [
                {**r, "child": c.get("backend")}
                for c, kid in zip((general, causal), kids)
                for r in kid.get("kv_read") or []
            ]
            tensor: dict[str, Any] = {}
            for lay in ("LBNHC", "LBHNC"):
                views = [(kid.get("registered_tensor") or {}).get(lay) for kid in kids]
                if views[0] is not None and views[0] == views[1]:
                    tensor[lay] = views[0]
            if tensor:
                tensor["default_layout"] = _default_layouts(kids, list(enum), pref)
            out[name] = {
                "class": cls_name,
                "source": src(path, cls_name),
                "name": [name],
                "composite": {
                    "general": general,
                    "causal": causal,
                    "options": opts,
                    "factory": generated,
                    "selected": _selected(s, name),
                    "mm_prefix_model_types": _mm_prefix_model_types(s),
                },
                # the generated class defines neither (``factory.defines``); 0.29+ backends
                # hand over KVCacheLayout views, as ``registered_tensor`` says
                "get_kv_cache_shape": None,
                "get_kv_cache_stride_order": None,
                "supported_kv_cache_layouts": {
                    "returns": [{"value": "get_supported_kv_cache_layouts((general, causal))"}],
                    "source": src(FACTORY_FILE, f"{FACTORY}.<locals>.supported_kv_cache_layouts"),
                },
                "impl": generated["impl"] if generated else None,
                "kv_read": reads,
                "registered_tensor": tensor or None,
            }
    return out
