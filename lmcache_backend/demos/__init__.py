"""Demos: ``server`` (vLLM's OpenAI server with the connector, the default of ``lmcache-backend
demo``) and ``hf`` (the HF-transformers engine in one process, ``lmcache-backend demo --engine
hf``)."""

from __future__ import annotations

import argparse

from lmcache_backend.settings.arguments import setting_type


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine",
        choices=("server", "hf"),
        default="server",
        help="server: RAG chats through vLLM's OpenAI server with the connector (default); "
        "hf: the HF-transformers engine in this process",
    )
    parser.add_argument(
        "--ratio",
        type=setting_type("blend_recompute_ratios", "item"),
        default=None,
        help="CacheBlend recompute ratio in [0, 1] (default: the configured "
        "blend_recompute_ratios)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, default=24, help="tokens per answer (default: 24)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    server = parser.add_argument_group("--engine server")
    server.add_argument("--chats", type=int, default=3, help="RAG chats to send")
    server.add_argument(
        "--chunk-repeat", type=int, default=2, help="repeat each document N times (longer prompts)"
    )
    hf = parser.add_argument_group("--engine hf")
    hf.add_argument("--check-layer", type=int, default=1, help="CacheBlend check layer")
    hf.add_argument("--repeats", type=int, default=5, help="timed runs per strategy")
    hf.add_argument("--example", type=int, default=0, help="built-in example index")


def main(args: argparse.Namespace) -> int:
    if args.engine == "hf":
        from lmcache_backend.demos import hf

        return hf.main(args)
    from lmcache_backend.demos import server

    return server.main(args)
