"""Engine keys: LMCache's configuration keys and this package's blend keys
(:class:`~lmcache_backend.config.BlendConfig`). Each is read from the YAML file named by
``LMCACHE_CONFIG_FILE``, its ``LMCACHE_<KEY>`` variable, vLLM's ``kv_connector_extra_config``
and keyword arguments (:func:`~lmcache_backend.config.load_config`)."""

from __future__ import annotations

from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.setting import Scope, Setting
from lmcache_backend.settings.store_keys import STORE_KEYS

BACKEND_CHOICES = ("auto", "torch", "cpu", "cuda", "ascend")
SEGMENTATION_CHOICES = ("auto", "separator", "blocks")
#: ``blend_preview_scored_layers`` values
SCORED_LAYER_CHOICES = ("global", "all")
#: the selections that run a preview pass (the read-share knob needs one)
PREVIEW_SELECTION_CHOICES = ("query_preview", "query_preview_last", "query_preview_stale")
#: token selectors (``lmcache_backend.blend.selectors.selection.SCORERS``, then the preview
#: selections); kv_deviation is LMCache's
SELECTION_CHOICES = (
    "kv_deviation",
    "kv_deviation_v",
    "query_attention",
    "query_kv_deviation",
    *PREVIEW_SELECTION_CHOICES,
)


_HEADS_AND_SCORED = (
    "docs/quality.md#chunk-heads-blend_chunk_head_tokens-and-scored-layers-"
    "blend_preview_scored_from"
)


def _key(name: str, parse: p.Parser, default, description: str, **more) -> Setting:
    return Setting(name, Scope.ENGINE, parse, default, description, **more)


ENGINE_KEYS: tuple[Setting, ...] = (
    _key(
        "enable_blending",
        p.boolean(),
        False,
        "master switch for CacheBlend",
        default_doc="`false` (`lmcache-backend serve` sets `true`)",
        group="blend",
    ),
    _key(
        "blend_special_str",
        p.text(),
        " # # ",
        "separator string between segments",
        details='`""`: no separator, chunks are found in blocks ([segmenting.md]'
        "(docs/segmenting.md))",
        group="blend",
    ),
    # Stock RAG prompts (LangChain, LlamaIndex) hold no separator: auto finds their chunks in
    # blocks and keeps whole-chunk reuse for prompts that mark chunks (docs/frameworks.md).
    _key(
        "blend_segmentation",
        p.choice(*SEGMENTATION_CHOICES),
        "auto",
        "how prompts are cut into cached units",
        details="`auto`: a prompt holding `blend_special_str` is cut around it, any other in "
        "blocks found at any offset (stock LangChain / LlamaIndex prompts, [frameworks.md]"
        "(docs/frameworks.md)); `separator`: LMCache's behaviour; `blocks`: blocks only",
        group="blend",
    ),
    _key(
        "blend_block_size",
        p.integer(minimum=1),
        16,
        "tokens per block of separator-free reuse",
        group="blend",
    ),
    # Defaults: the best measured trade-off within 25% of token-layers (docs/quality.md).
    # LMCache's behaviour: blend_selection=kv_deviation with LMCache's ratios and check layers.
    _key(
        "blend_recompute_ratios",
        p.number_list(p.number(0.0, 1.0), "ratio"),
        [0.2],
        "share of the reusable tokens recomputed: one value, or one per check layer",
        details="0: naive reuse, 1: recompute everything. With several check layers each ratio "
        "is a share of **all** reusable tokens and a later layer selects among those still "
        "active (`[1, 2]` with `[0.3, 0.15]` is the paper's gradual filtering)",
        group="blend",
        per_request=True,
    ),
    _key(
        "blend_check_layers",
        p.layer_list(),
        [1],
        "layers where the check-layer selections choose tokens",
        details="each must exist in the model",
        group="blend",
        per_request=True,
    ),
    _key(
        "blend_selection",
        p.choice(*SELECTION_CHOICES),
        "query_preview_last",
        "how the recomputed tokens are chosen",
        details="`kv_deviation` is LMCache's; the preview selections (`query_preview*`) run the "
        "question over the cached K/V first "
        "([quality.md](docs/quality.md#selectors-blend_selection-lmcache_blend_selection))",
        group="blend",
        per_request=True,
    ),
    # The fidelity knob: a prompt whose question reads many reused tokens gets more recompute
    # than one that reads a few (blend/selectors/read_share.py, docs/quality.md "The fidelity
    # knob").
    _key(
        "blend_min_read_share",
        p.number(0.0, 1.0, below_maximum=True),
        0.0,
        "preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until the "
        "recomputed ones hold this share of what the question reads of the reused text",
        details="how far from full prefill a blend may go, as the request itself measures it "
        "(the stats record's `read_share`); 0: the ratio alone decides "
        "([quality.md](docs/quality.md#the-fidelity-knob-blend_min_read_share))",
        group="blend",
        per_request=True,
    ),
    _key(
        "blend_max_recompute_ratio",
        p.number(0.0, 1.0),
        0.5,
        "the largest share of the reusable tokens that `blend_min_read_share` and "
        "`blend_max_divergence` may recompute",
        details="the knobs' cost cap; never below the ratio of `blend_recompute_ratios`",
        group="blend",
        per_request=True,
    ),
    # The divergence knob: the blend's own estimate of how far it stays from full prefill
    # (blend/selectors/staleness.py, docs/quality.md "The divergence knob").
    _key(
        "blend_max_divergence",
        p.number(minimum=0.0),
        0.0,
        "preview selections recompute more tokens, up to `blend_max_recompute_ratio`, until "
        "the blend's divergence estimate is at most this",
        details="the estimate (the stats record's `divergence`) is the staleness-weighted share "
        "of the last prompt token's attention left on tokens not recomputed; 0: off "
        "([quality.md](docs/quality.md#the-divergence-knob-blend_max_divergence))",
        group="blend",
        per_request=True,
    ),
    # Late tokens cost more to recompute (attention over more keys) and, measured, help less
    # than their preview score says (docs/quality.md, "Position discount").
    _key(
        "blend_position_discount",
        p.number(minimum=0.0),
        10.0,
        "preview selections divide a token's score by 1 + d * position / prompt length",
        details="late tokens cost more to recompute and helped less "
        "([quality.md](docs/quality.md#position-discount-blend_position_discount)); 0: every "
        "position scored alike",
        group="blend",
    ),
    # Consecutive selected tokens are cheaper to attend for (one run of queries reads the keys
    # once): docs/measurements/spans.md.
    _key(
        "blend_selection_span",
        p.integer(minimum=1),
        1,
        "preview selections recompute aligned spans of this many consecutive tokens",
        details="cheaper attention per recomputed token on CPU, answers further from full "
        "prefill ([measured](docs/measurements/spans.md)); 1: single tokens",
        group="blend",
    ),
    # Models whose recomputed tokens lean on each chunk's first tokens (Gemma 3) answer closer to
    # full prefill when those are recomputed first; others lose by it (docs/quality.md).
    _key(
        "blend_chunk_head_tokens",
        p.integer(minimum=0),
        0,
        "preview selections recompute the first this many tokens of every reused chunk first",
        details="inside the same budget: closer to full prefill on Gemma 3, further on SmolLM2 "
        f"([measured]({_HEADS_AND_SCORED}))",
        group="blend",
    ),
    # Shallow layers' cached K/V barely drift, so their reads point at tokens whose recompute
    # pays little (docs/quality.md, "Scored layers").
    _key(
        "blend_preview_scored_from",
        p.number(0.0, 1.0, below_maximum=True),
        0.0,
        "preview selections score the reads of the layers from this share of the depth on",
        details="the preview still runs every layer; `0.34` is closer to full prefill on "
        f"Gemma 3, further on SmolLM2 ([measured]({_HEADS_AND_SCORED}))",
        group="blend",
    ),
    # A sliding-window layer shorter than the prompt reads only the prompt's end, whatever the
    # answer needs from the rest (docs/quality.md, "Windowed layers").
    _key(
        "blend_preview_scored_layers",
        p.choice(*SCORED_LAYER_CHOICES),
        "global",
        "which layers' reads the preview selections score",
        details="`global`: the layers that attend over the whole prompt (every layer where "
        "none does; a sliding window shorter than the prompt reads only its end); `all`: every "
        "layer's. Models without windows are unaffected "
        "([measured](docs/quality.md#windowed-layers-blend_preview_scored_layers))",
        group="blend",
    ),
    _key(
        "blend_min_tokens",
        p.integer(minimum=0),
        256,
        "fewer reusable tokens than this: the prompt is prefilled as usual (logged)",
        group="blend",
    ),
    # Measured blends cost about their token-layer share of a full prefill plus a few percent
    # (lookup, load, write-back): 0.6 keeps every claimed request well below 1x (blend/pays.py).
    _key(
        "blend_max_cost",
        p.number(minimum=0.0, above_minimum=True),
        0.6,
        "a prompt whose predicted blend costs more than this share of a full prefill's "
        "token-layers is prefilled as usual",
        details="(new text inside the reused span, a long fresh tail; [segmenting.md]"
        "(docs/segmenting.md)), logged with `reason: would not pay`; 1: blend whenever anything "
        "is reused. A request that sets its own blend settings in `kv_transfer_params` asked "
        "for that blend and is not held to it",
        group="blend",
    ),
    _key(
        "backend",
        p.choice(*BACKEND_CHOICES),
        "auto",
        "op backend",
        details="`auto`: CUDA on NVIDIA, Ascend on an NPU, the CPU kernels on a CPU, the torch "
        "references where those cannot load (logged)",
        group="ops",
    ),
    _key(
        "use_layerwise",
        p.boolean(),
        True,
        "LMCache's key; CacheBlend always runs layer by layer (false is logged and ignored)",
        group="ops",
    ),
    _key("local_cpu", p.boolean(), True, "keep segments in CPU memory", group="storage"),
    _key(
        "max_local_cpu_size",
        p.number(minimum=0.0, above_minimum=True, unit="(GB)"),
        5.0,
        "CPU tier capacity, GB (2^30 bytes)",
        group="storage",
    ),
    _key(
        "local_disk",
        p.optional(p.text(allow_empty=False)),
        None,
        "folder of the disk tier (one safetensors file per segment); `file:///path` works",
        group="storage",
    ),
    _key(
        "max_local_disk_size",
        p.number(minimum=0.0, unit="(GB)"),
        0.0,
        "disk tier capacity, GB; the disk tier is on only when this is > 0",
        group="storage",
    ),
    _key(
        "remote_url",
        p.optional(p.text(allow_empty=False)),
        None,
        "shared Redis tier: one server, a Redis Cluster or Sentinel",
        details="`redis://host:port[/db]`, `rediss://` (TLS), `unix:///path.sock`; "
        "`redis+cluster://h:p,h:p` (or several nodes, `?cluster=true`); "
        "`redis-sentinel://h:p,h:p[/master]` ([forms]"
        "(docs/storage.md#the-shared-tier-one-server-a-cluster-or-sentinel)); an unusable "
        "URL stops the start with an error naming it",
        group="storage",
    ),
    _key(
        "extra_config",
        p.json_object(),
        {},
        "further settings (a JSON object): the store's keys below, LMCache's own",
        details="[storage.md](docs/storage.md#configuration)",
        group="storage",
        hidden_keys=tuple(s.name for s in STORE_KEYS if s.secret),
    ),
)

#: LMCache keys this package accepts and does not use, so an LMCache configuration loads without
#: warnings. Anything else unknown gets a warning naming the closest known key.
LMCACHE_KEYS_IGNORED = frozenset(
    {
        "chunk_size",
        "save_decode_cache",
        "remote_serde",
        "pre_caching_hash_algorithm",
        "save_unfull_chunk",
        "blocking_timeout_secs",
        "enable_p2p",
        "lookup_url",
        "distributed_url",
        "enable_controller",
        "lmcache_instance_id",
        "controller_url",
        "lmcache_worker_port",
        "use_mla",
        "cufile_buffer_size",
        "log_level",
        "config_file",
        "enable_async_loading",
        "internal_api_server_enabled",
    }
)
