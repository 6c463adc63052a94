"""The vLLM connector's own keys (``kv_connector_extra_config`` only) and the keys a request may
set in its ``kv_transfer_params`` (besides the engine keys marked ``per_request``)."""

from __future__ import annotations

from lmcache_backend.compat.vllm import SLICED_VERIFIED_RELEASE
from lmcache_backend.settings import parsers as p
from lmcache_backend.settings.setting import Scope, Setting

#: ``selected_attention`` values: the kernel of the selected tokens' attention in vLLM's forward
SELECTED_ATTENTION_CHOICES = ("auto", "tiled", "vllm")


def _connector(name: str, parse: p.Parser, default, description: str, **more) -> Setting:
    return Setting(name, Scope.CONNECTOR, parse, default, description, **more)


CONNECTOR_KEYS: tuple[Setting, ...] = (
    _connector(
        "instance_id",
        p.optional(p.text(allow_empty=False)),
        None,
        "names this engine's cross-process segment index (scheduler and workers)",
        details="a plain name; engines on one machine need different ones",
        default_doc="`vllm-<engine_id>` (vLLM's `engine_id`)",
    ),
    _connector(
        "stats_file",
        p.optional(p.text(allow_empty=False)),
        None,
        "append one JSON line per request the connector saw",
        details='Blended (`"blended": true`): tokens, claimed, reusable, recomputed, '
        "`recompute_fraction`, `token_layer_fraction`, `attention_fraction` (the last layer's "
        "query-key pairs as a share of a full prefill's), `read_share` (what the recomputed "
        "tokens hold of the question's reads, preview selections), `divergence` (the blend's "
        "divergence estimate, preview selections). Left to vLLM "
        '(`"blended": false`): `reason` (`blending '
        "off`, `opted out`, `lora`, `no reusable span`, `below blend_min_tokens`, `would not "
        "pay`), `detail`, `num_reusable`, `predicted_cost_share`; the server's log says the "
        "same per request",
    ),
    _connector(
        "allow_untested_versions",
        p.boolean(),
        False,
        "run a vLLM / vllm-ascend release the version gate has no record of, with the nearest "
        "code path",
        details="see [Versions](docs/vllm.md#versions)",
    ),
    _connector(
        "verify_on_start",
        p.boolean(),
        False,
        "run `lmcache-backend verify`'s model checks once at start-up and log the result",
    ),
    _connector(
        "time_phases",
        p.boolean(),
        False,
        "time the phases of each blended request into `stats_file`'s records "
        "(`phases_ms`, milliseconds per phase)",
        aliases=("profile",),
    ),
    _connector(
        "blend_layers_per_step",
        p.count_or_auto(),
        "auto",
        "layer passes of a sliced (asynchronous) blend per engine step; 0: blend at once",
        details="`auto`: claims of at least vLLM's `max_num_batched_tokens` (4,096 on the CPU "
        "build) are sliced, 8 passes a step, shorter ones blended in one go: a blend longer "
        "than one of vLLM's own prefill steps does not stall the other requests for its whole "
        "length, and a short one keeps its time to first token (sliced, a 1k/2k-token blend "
        "took 31%/22% longer, [measurements](docs/measurements/sliced-loads.md)); on a vLLM "
        "release other "
        f"than the one whose asynchronous loads were checked ({SLICED_VERIFIED_RELEASE}) `auto` "
        "blends in one go "
        "(logged). `n > 0`: prompts with a preview selection load as vLLM asynchronous KV "
        "loads, `n` layer passes per step, so decode streams keep producing tokens between "
        "the slices (a preview through vLLM's forward pass is one pass and a step of its own); "
        "check-layer selections stay synchronous. `0`: every other running request waits for "
        "the whole blend. A fixed pass count, never a "
        "time budget (tensor-parallel ranks run the same collectives). Records gain "
        "`blend_steps` and `blend_wall_ms` (`blend_ms` is the blend's own time) "
        "([details](docs/vllm-internals.md#sliced-loads-blend_layers_per_step))",
    ),
    _connector(
        "engine_forward",
        p.boolean(),
        True,
        "run a preview selection's preview and then the selected tokens through vLLM's own "
        "compiled forward pass",
        details="each layer's attention and attention mass are computed by the blender over its "
        "cached K/V, and the selected tokens attend over the blended paged cache (vLLM's CPU "
        "attention backend); `false`: the blender's layer-by-layer path for both, which the "
        "check-layer selections always use and sliced loads use for the selected tokens ([details]"
        "(docs/vllm-internals.md#the-selected-tokens-through-vllms-forward-pass-engine_forward))",
    ),
    _connector(
        "selected_attention",
        p.choice(*SELECTED_ATTENTION_CHOICES),
        "auto",
        "kernel of the selected tokens' attention (vLLM's forward pass and the layer-by-layer "
        "path alike)",
        details="`auto`: the blend's tiled CPU kernel where it builds and runs (x86-64 with "
        "AVX-512 BF16, a bf16 KV cache, a C++ compiler; built once, about 30 s, into "
        "`$LMCACHE_KERNEL_CACHE`), else vLLM's CPU attention, with a warning saying why; "
        "`tiled`: the tiled kernel or an error at start; `vllm`: vLLM's CPU attention "
        "([details](docs/vllm-internals.md#the-tiled-attention-kernel-selected_attention)). "
        "On CUDA and Ascend: `tiled` (and `auto` on CUDA) attends over a layer's contiguous "
        "rows with the backend's `attention_at_positions` where the blend holds them "
        "(check-layer selections such as `kv_deviation`), else through the block table; "
        "`vllm` (and `auto` on Ascend) always through the block table with "
        "`paged_attention_at_positions` ([cuda.md](docs/cuda.md#the-blend-on-a-gpu))",
    ),
)

#: LMCache's request key that keeps a request's K/V out of the store
SKIP_SAVE = "lmcache.skip_save"
#: the request key of a staleness probe (``lmcache-backend ingest --staleness-probes``)
STALENESS_PROBES = "lmcache.staleness_probes"

REQUEST_ONLY_KEYS: tuple[Setting, ...] = (
    Setting(
        "blend",
        Scope.REQUEST,
        p.boolean(),
        True,
        "`false`: no reuse for this request (a full prefill on the same engine)",
    ),
    # LMCache's own request key: a request whose K/V nobody will ask for again (a one-off
    # prompt, a benchmark's reference run) need not fill the store.
    Setting(
        SKIP_SAVE,
        Scope.REQUEST,
        p.boolean(),
        False,
        "`true`: this request's K/V are not written to the store (it may still reuse what the "
        "store holds)",
    ),
    # A probe computes stored chunks after other passages and measures how far their K/V move:
    # the prior the staleness-aware selection reads (blend/segments/staleness_prior.py).
    Setting(
        STALENESS_PROBES,
        Scope.REQUEST,
        p.integer(minimum=0),
        0,
        "`K` > 0: this request is a staleness probe: nothing is stored; each stored segment it "
        "holds that was computed in another context is measured, and its entry gets a "
        "staleness prior after `K` probes (`lmcache-backend ingest --staleness-probes`)",
    ),
)
