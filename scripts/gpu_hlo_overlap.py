"""Compile the ENGINE's step program (tbjax.engine.runner.ModelRunner, one shard_map per token bucket) on an 8-GPU
sm_90 target WITHOUT a GPU and report, from the schedule of the optimized HLO's entry computation, how each layer's
DP-sharded attention-weight gather is placed relative to the attention of the layer before it (used by
tests/sharding/test_sharding_hlo.py; runnable by hand).

Needs the CUDA 12 PJRT plugin importable (it is NOT a dependency of tbjax):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
    PYTHONPATH=/tmp/cuda12plugin JAX_PLATFORMS=cpu python scripts/gpu_hlo_overlap.py [--schedule]
It compiles against `jax.experimental.topologies.get_topology_desc(..., "cuda")` with the H100 target config in
tests/data/gpu_targets (a copy of ../shared/gpu_targets; sm_90, the H200 is the same chip) and prints, last, one
JSON line: a list, one object per variant <gather>:<ep mode>[:forward] (see `analyse` for the fields).

The program is unrolled (tbjax/model/transformer.py run_layers): layer l+1's gather (`sharding/prefetch.py`
gather_buffer: one all-gather, or a ring of N-1 collective-permutes) is issued in program order before layer l's
attention, and the optimized module is scheduled, so the entry computation's instruction order IS the schedule.
What is found there:
  * buffer collectives: collectives whose operands are shards of the packed buffer (u8[plan.attn_shard_bytes]);
    their layer is found by data flow, from the slice [l:l+1] of the packed parameter u8[L, shard] they read,
    through bitcasts/copies, ring steps and the tuple elements of combined (multi-operand) collectives;
  * attention: entry instructions whose computation (itself or what it calls: while bodies, conditionals, fusions)
    holds an attention-score matmul, a gemm fusion (or dot) producing f32[..., n_heads, span] (the engine's blocked
    paged attention, `pallas_kernels/paged_attention/blocked.py`, scores a block of `span` kv tokens per while-loop
    iteration) or f32[n_heads, T, T] (dense attention of the whole-sequence forward); grouped into L consecutive
    equal runs (layer l+1's attention depends on layer l's output, so runs cannot interleave);
  * per layer l < L-1: does the gather of layer l+1 start before layer l's first attention instruction and finish
    (last done) after its last one; how many gathered layers are live at once (from a layer's first collective
    start to the last use of its gathered bytes or of views/slices of them);
  * memory_analysis(): temp and argument bytes (compare with the replicated layout, `DecodeLayout(attn_axes=())`).
The `forward` suffix compiles tbjax.model.mesh_forward.make_forward (whole sequences, dense attention, same loop).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TARGET = os.environ.get("TBJAX_GPU_TARGET_CONFIG",
                        os.path.join(ROOT, "tests", "data", "gpu_targets", "h100_sxm.txtpb"))

# The test suite compiles XLA:CPU at -O0 (tests/conftest.py FAST_COMPILE_FLAGS) and its subprocesses inherit that;
# the programs analysed here are compiled for the GPU with XLA's default settings (before jax is imported).
_FAST = ("--xla_backend_optimization_level", "--xla_llvm_disable_expensive_passes")
os.environ["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FAST))


# ---- HLO text ------------------------------------------------------------------------------------------------------
def split_computations(hlo: str) -> dict[str, list[str]]:
    comps, cur = {}, None
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            cur = m.group(1)
            comps[cur] = []
        elif cur is not None:
            comps[cur].append(line)
    return comps


def entry_name(hlo: str) -> str:
    return re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)


# `%name = <shape> <opcode>(<operands>), <attributes>`; a tuple shape may hold '/*index=5*/' comments, the opcode is
# the first lower-case word directly followed by '(' after the shape.
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+) = (.+?) ([a-z][\w\-]*)\((.*)$")
CALLEES = re.compile(r"(?:calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")


@dataclasses.dataclass
class Instr:
    pos: int
    name: str
    shape: str
    op: str
    operands: list
    attrs: str
    line: str

    @property
    def callees(self) -> list[str]:
        out = CALLEES.findall(self.attrs)
        m = re.search(r"branch_computations=\{([^}]*)\}", self.attrs)
        if m:
            out += re.findall(r"%?([\w.\-]+)", m.group(1))
        return out


def _split_operands(rest: str) -> tuple[str, str]:
    depth, i = 1, 0
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    return rest[: i - 1], rest[i:]


def parse(lines: list[str]) -> list[Instr]:
    out = []
    for ln in lines:
        m = INSTR.match(ln)
        if not m:
            continue
        args, attrs = _split_operands(m.group(4))
        out.append(Instr(len(out), m.group(1), m.group(2), m.group(3), re.findall(r"%([\w.\-]+)", args), attrs, ln))
    return out


def _tuple_elems(shape: str) -> list[str]:
    """Top-level element shapes of a tuple shape '(a, (b, c), d)' (one element for a non-tuple)."""
    s = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not s.startswith("("):
        return [s]
    s, out, depth, cur = s[1:-1], [], 0, ""
    for ch in s:
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


# ---- analysis ------------------------------------------------------------------------------------------------------
VIEW_OPS = {"bitcast", "copy", "reshape", "get-tuple-element", "copy-start", "copy-done", "transpose"}
COLLECTIVE = re.compile(r"^(all-gather|collective-permute|all-reduce|reduce-scatter|all-to-all)(-start|-done)?$")


def score_pattern(n_heads: int, span: int | None = None, tokens: int | None = None) -> str:
    """The attention-score matmul, a gemm fusion (or dot) with a float32 result: inside the blocked paged attention's
    while loops a float32 result with a `span` dimension (`span` kv tokens scored per iteration: decodes
    f32[S, N, span]; a prefill query tile's gemm comes out as f32[span, rows * N] in column-major layout); dense
    attention f32[N, (1,) T, T]."""
    shape = (rf"f32\[(?:\d+,)*{span}(?:,\d+)*\]" if span is not None
             else rf"f32\[{n_heads},(?:1,)?{tokens},{tokens}\]")
    return rf"= {shape}\S* (?:fusion\(.*calls=%gemm|dot\()"


def _contains(comps: dict, name: str, rx, memo: dict) -> bool:
    if name in memo:
        return memo[name]
    memo[name] = False
    hit = False
    for ins in parse(comps.get(name, [])):
        if rx.search(ins.line) or any(_contains(comps, c, rx, memo) for c in ins.callees):
            hit = True
            break
    memo[name] = hit
    return hit


def _slice_start(ins: Instr, comps: dict) -> int | None:
    """Row l of `slice={[l:l+1], ...}` in the instruction or in the computation it calls (a wrapped slice)."""
    texts = [ins.attrs] + ["\n".join(comps.get(c, [])) for c in ins.callees]
    for t in texts:
        m = re.search(r"slice=\{\[(\d+):(\d+)\]", t)
        if m and int(m.group(2)) == int(m.group(1)) + 1:
            return int(m.group(1))
    return None


def analyse(hlo: str, shard_bytes: int, n_layers: int, score: str, in_loops: bool = True) -> dict:
    """The schedule facts of an unrolled layer loop (see the module docstring). `score`: regex of an attention-score
    line (`score_pattern`); in_loops: attention = the entry's while loops whose bodies (or what they call) hold a
    score line (the engine's blocked paged attention), else the entry's own score lines (dense attention)."""
    comps = split_computations(hlo)
    entry = entry_name(hlo)
    ins = parse(comps[entry])
    packed_params = {i.name for i in ins if i.op == "parameter" and re.match(rf"^u8\[\d+,{shard_bytes}\]", i.shape)}

    # ---- layer ownership by data flow ----
    own: dict = {}                      # name -> layer, or a list (per tuple element) of layers / None
    colls = []                          # buffer collectives: (instr, phase, layers)
    def owner_of(name, index=None):
        o = own.get(name)
        if isinstance(o, list):
            return o[index] if index is not None and index < len(o) else None
        return o
    for i in ins:
        m = COLLECTIVE.match(i.op)
        if i.op == "parameter":
            continue
        if any(p in packed_params for p in i.operands) and i.op != "get-tuple-element":
            own[i.name] = _slice_start(i, comps)
            continue
        if i.op == "tuple":             # e.g. the operand of an opt-barrier (run_layers ties shards to activations)
            elems = [owner_of(o) for o in i.operands]
            if any(isinstance(e, int) for e in elems):
                own[i.name] = elems
            continue
        if i.op == "opt-barrier":
            own[i.name] = own.get(i.operands[0]) if i.operands else None
            continue
        if i.op == "get-tuple-element":
            idx = int(re.search(r"index=(\d+)", i.attrs).group(1))
            own[i.name] = owner_of(i.operands[0], idx) if i.operands else None
            continue
        if m:
            phase = (m.group(2) or "-sync")[1:]
            if phase == "done":
                own[i.name] = own.get(i.operands[0])
                layers = own[i.name]
            else:
                ops = [owner_of(o) for o in i.operands]
                layers = ops[0] if len(ops) == 1 else ops
                own[i.name] = layers
            lays = sorted({x for x in (layers if isinstance(layers, list) else [layers]) if x is not None})
            if lays:
                colls.append((i, m.group(1), phase, lays))
            continue
        owners = {owner_of(o) for o in i.operands if isinstance(owner_of(o), int)}
        if len(owners) == 1 and (i.op in VIEW_OPS or i.shape.startswith("u8[")):
            own[i.name] = owners.pop()

    # ---- per layer: collectives, live range ----
    layers = []
    for l in range(n_layers):
        cs = [(c, kind, ph) for c, kind, ph, lays in colls if l in lays]
        starts = [c.pos for c, _, ph in cs if ph in ("start", "sync")]
        dones = [c.pos for c, _, ph in cs if ph in ("done", "sync")]
        # uses of the layer's bytes (a get-tuple-element of a combined collective is a view, not a use: its own
        # consumers are; a combined collective's other elements belong to the other layers)
        uses = [j.pos for j in ins if j.op != "get-tuple-element" and any(owner_of(o) == l for o in j.operands)]
        layers.append({
            "layer": l,
            "collectives": [{"name": c.name, "kind": kind, "phase": ph, "pos": c.pos,
                             "combined": sorted({x for x in (own[c.name] if isinstance(own[c.name], list)
                                                             else [own[c.name]]) if x is not None})}
                            for c, kind, ph in cs],
            "first_start": min(starts) if starts else None, "last_done": max(dones) if dones else None,
            "last_use": max(uses) if uses else None})

    # ---- attention ----
    rx, memo = re.compile(score), {}
    if in_loops:
        attn = [i.pos for i in ins if i.op == "while" and any(_contains(comps, c, rx, memo) for c in i.callees)]
    else:
        attn = [i.pos for i in ins if rx.search(i.line)]
    per = len(attn) // n_layers if attn and len(attn) % n_layers == 0 else None
    attn_layers = [attn[l * per:(l + 1) * per] for l in range(n_layers)] if per else None

    # ---- checks ----
    checks = []
    for l in range(n_layers - 1):
        nxt = layers[l + 1]
        a = attn_layers[l] if attn_layers else []
        s, d = nxt["first_start"], nxt["last_done"]
        ok = bool(a) and s is not None and d is not None and s < a[0] and d > a[-1]
        checks.append({"layer": l, "prefetch_of": l + 1, "start": s, "done": d,
                       "attention": [a[0], a[-1]] if a else None,
                       "attention_between": sum(1 for p in a if s is not None and d is not None and s < p < d),
                       "brackets_attention": ok})
    ranges = [(L["first_start"], L["last_use"] if L["last_use"] is not None else L["last_done"]) for L in layers]
    flight = [(L["first_start"], L["last_done"]) for L in layers]
    def max_overlap(rs):
        rs = [(a, b) for a, b in rs if a is not None and b is not None]
        return max((sum(1 for a, b in rs if a <= p <= b) for p in range(len(ins))), default=0)
    sync = sum(1 for _, _, ph, _ in colls if ph == "sync")
    combined = sum(1 for c, _, ph, lays in colls if len(lays) > 1 and ph != "done")
    nested = sum(1 for n, lines in comps.items() if n != entry for ln in lines
                 if re.search(rf"= [^=]*u8\[{shard_bytes}\][^=]* (?:all-gather|collective-permute)", ln))
    return {"layers": layers, "attention": attn_layers, "attention_instructions": len(attn), "checks": checks,
            "max_live_layers": max_overlap(ranges), "max_in_flight_layers": max_overlap(flight),
            "sync_buffer_collectives": sync, "combined_buffer_collectives": combined,
            "buffer_collectives_outside_entry": nested, "entry_instructions": len(ins)}


def schedule_excerpt(hlo: str, res: dict, extra=r"(all-gather|collective-permute|reduce-scatter|all-to-all|all-reduce)"
                     r"(-start|-done)?$") -> list[str]:
    """The entry schedule reduced to buffer collectives (with their layer), attention instructions (with theirs)
    and the other collectives: one line per instruction, 'pos: name op [what]'."""
    ins = parse(split_computations(hlo)[entry_name(hlo)])
    tag = {}
    for L in res["layers"]:
        for c in L["collectives"]:
            tag[c["pos"]] = f"buffer gather of layer(s) {c['combined'] or [L['layer']]}"
    for l, ps in enumerate(res["attention"] or []):
        for p in ps:
            tag[p] = f"attention of layer {l}"
    out = []
    for i in ins:
        if i.pos in tag or re.match(extra, i.op):
            out.append(f"{i.pos:5d}: {i.name} = {i.shape[:48]} {i.op} [{tag.get(i.pos, 'other collective')}]")
    return out


# ---- building the engine's program on a compile-only (topology) mesh ------------------------------------------------
@contextlib.contextmanager
def abstract_placement():
    """Build a ModelRunner around ShapeDtypeStructs: ModelRunner.__init__ places its parameters with jax.device_put
    (sharding.rules.shard_tree) after transforming them (packing, folding, splitting), and init_caches zero-fills
    pools with jitted calls; a compile-only client (the topology devices) can do none of it. Inside this context
    device_put returns ShapeDtypeStructs that carry the requested sharding, the tree transforms run under
    jax.eval_shape, and the `jit` yielded replaces jax.jit for init_caches (see `abstract_runner`)."""
    import jax

    from tbjax.engine import runner as rmod
    from tbjax.model import mesh_forward as mf

    def put(x, device=None, **kw):
        if device is None or isinstance(device, jax.sharding.Sharding):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), x)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), x, device)

    def jit(f, out_shardings=None, **kw):
        return lambda *a: jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=out_shardings),
                                       jax.eval_shape(f, *a))

    saved = (jax.device_put, mf.mesh_tree, rmod.fold_layer_norms, rmod.split_layer_buffers)
    tree, fold, split = saved[1:]
    jax.device_put = put
    mf.mesh_tree = lambda p, plan, fp8=None: jax.eval_shape(lambda q: tree(q, plan, fp8), p)
    rmod.fold_layer_norms = lambda spec, p: jax.eval_shape(lambda q: fold(spec, q), p)
    rmod.split_layer_buffers = lambda p: jax.eval_shape(split, p)
    try:
        yield jit
    finally:
        jax.device_put, mf.mesh_tree, rmod.fold_layer_norms, rmod.split_layer_buffers = saved


def abstract_runner(spec, mesh, layout, *, kv_pages: int, page_size: int, max_num_seqs: int, max_tokens: int,
                    max_pages_per_seq: int, attn_impl: str = "auto", matmul_impl: str = "auto",
                    layer_buffers: str = "stacked", fold_norms: bool = False, weight_dtype: str = "bf16"):
    """A ModelRunner (the engine's) on `mesh` (devices may be compile-only) with abstract params and KV pools of
    `kv_pages` pages per dp rank; compile a bucket with `compile_bucket`. `weight_dtype` other than bf16: the
    matrices as abstract QuantizedWeights of that format (tbjax.model.quant, resident as the engine holds them)."""
    import jax

    from tbjax.engine.kv_cache import KVCacheConfig
    from tbjax.engine.runner import ModelRunner
    from tbjax.model.params import param_shapes

    params = param_shapes(spec, spec.dtype)
    if weight_dtype != "bf16":
        from tbjax.model import quant
        fmt, group = ("fp8", 128) if weight_dtype == "fp8-block" else (weight_dtype, None)
        params = jax.eval_shape(lambda p: quant.quantize_tree(p, fmt, on_device=True, group=group), params)
    with abstract_placement() as jit:
        runner = ModelRunner(spec, params, mesh=mesh, layout=layout, page_size=page_size, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_tokens, max_pages_per_seq=max_pages_per_seq,
                             attn_impl=attn_impl, matmul_impl=matmul_impl, layer_buffers=layer_buffers,
                             fold_norms=fold_norms)
        real_jit, jax.jit = jax.jit, jit
        try:
            runner.init_caches(KVCacheConfig(num_pages=kv_pages, page_size=page_size, dtype=spec.dtype))
        finally:
            jax.jit = real_jit
    return runner


def compile_bucket(runner, bucket: int, compiler_options: dict | None = None, decode_only: bool = False):
    """The optimized executable of the runner's step program for token bucket `bucket` (`runner._fn((bucket,
    decode_only))`; decode_only: the bucket's decode program, which only buckets in `runner.decode_buckets` have)."""
    if decode_only and bucket not in runner.decode_buckets:
        raise ValueError(f"bucket {bucket} has no decode program (decode buckets: {runner.decode_buckets})")
    return runner._fn((bucket, decode_only)).trace(*runner._abstract_args(bucket)).lower().compile(
        compiler_options=compiler_options or None)


def gpu_mesh(n: int):
    """An n-GPU sm_90 topology mesh with the engine's axes (dp=n), axis types as the runner makes them (Auto)."""
    import jax
    import numpy as np
    from jax.experimental import topologies
    with open(TARGET) as f:
        topo = topologies.get_topology_desc(f"h100x{n}", "cuda", target_config=f.read(), topology=f"1x1x{n}")
    devs = np.array(topo.devices[:n]).reshape(n, 1, 1, 1)
    return jax.sharding.Mesh(devs, ("dp", "ep", "tp", "pp"), axis_types=(jax.sharding.AxisType.Auto,) * 4)


def deepseek_spec(layers: int, hidden: int):
    """A DeepSeek-V3-shaped model (MLA + group-routed MoE with a shared expert, first layer dense), scaled down."""
    from tbjax.spec import ModelSpec
    with open(os.path.join(ROOT, "tests", "data", "hf_moe", "deepseek_v3", "config.json")) as f:
        cfg = json.load(f)
    D = hidden
    cfg.update(hidden_size=D, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=D // 2,
               kv_lora_rank=D // 4, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
               moe_intermediate_size=D // 4, intermediate_size=2 * D, n_routed_experts=32, n_group=4, topk_group=2,
               num_experts_per_tok=4, num_hidden_layers=layers, first_k_dense_replace=1, vocab_size=1024)
    return ModelSpec.from_hf_config(cfg).replace(dtype="bfloat16")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="all_gather:gather,ppermute:gather,replicated:gather",
                    help="comma-separated <attn gather>:<ep mode>[:forward]; gather 'replicated' = attn_axes=(); "
                         "':forward' compiles mesh_forward.make_forward (whole sequences) instead of the engine step")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16, help="engine: token bucket per rank (= max_num_batched_tokens "
                    "= max_num_seqs); forward: tokens per device")
    ap.add_argument("--ctx", type=int, default=1024, help="engine: max tokens per sequence (block table width)")
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--xla-option", action="append", default=[], metavar="K=V",
                    help="extra XLA compile option for every variant (experiments), e.g. "
                         "xla_gpu_experimental_parallel_collective_overlap_limit=2")
    ap.add_argument("--dump", default=None, help="write each optimized HLO to <dump>.<variant>.txt")
    ap.add_argument("--schedule", action="store_true", help="print each variant's reduced schedule (stderr)")
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    sys.path.insert(0, ROOT)
    from pallas_kernels.paged_attention import blocked
    from sharding import rules as sr
    from sharding.mesh import DecodeLayout
    from tbjax.model import mesh_forward as mf

    opts = dict(kv.split("=", 1) for kv in a.xla_option)
    mesh = gpu_mesh(a.devices)
    spec = deepseek_spec(a.layers, a.hidden)
    results = []
    for v in a.variants.split(","):
        gather, ep_mode, *prog = v.split(":")
        prog = prog[0] if prog else "step"
        lay = (DecodeLayout(attn_axes=(), ep_mode=ep_mode) if gather == "replicated"
               else DecodeLayout(attn_gather=gather, ep_mode=ep_mode))
        if prog == "step":
            S = a.tokens
            runner = abstract_runner(spec, mesh, lay, kv_pages=1 + S * (a.ctx // a.page), page_size=a.page,
                                     max_num_seqs=S, max_tokens=S, max_pages_per_seq=a.ctx // a.page)
            plan = runner.plan
            compiled = compile_bucket(runner, runner.buckets[-1], opts)
            score, in_loops = score_pattern(spec.n_heads, span=blocked._block_pages(a.page) * a.page), True
            extra = {"bucket": runner.buckets[-1], "sequence_slots": runner.seqs_for(runner.buckets[-1]),
                     "pages_per_seq": a.ctx // a.page}
        elif prog == "forward":
            plan = mf.make_plan(spec, mesh, lay)
            tree = mf.abstract_mesh_params(plan)
            shs = sr.shardings(tree, mf.mesh_rules(plan), mesh)
            atree = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), tree, shs)
            tok = jax.ShapeDtypeStruct((a.devices * a.tokens,), jnp.int32,
                                       sharding=NamedSharding(mesh, P(tuple(lay.batch_axes))))
            fwd = mf.make_forward(plan, mesh, tree)
            compiled = fwd.jitted.trace(atree, tok, tok, tok).lower().compile(compiler_options=opts or None)
            score, in_loops = score_pattern(spec.n_heads, tokens=a.tokens), False
            extra = {"tokens_per_device": a.tokens}
        else:
            raise SystemExit(f"--variants: unknown program {prog!r} in {v!r} (step or forward)")
        hlo = compiled.as_text()
        if a.dump:
            with open(f"{a.dump}.{v.replace(':', '.')}.txt", "w") as f:
                f.write(hlo)
        res = analyse(hlo, plan.attn_shard_bytes, spec.n_layers, score, in_loops)
        if a.schedule:
            print(f"== {v}", *schedule_excerpt(hlo, res), sep="\n", file=sys.stderr)
        mem = compiled.memory_analysis()
        res.update(variant=v, program=prog, gather=gather, ep_mode=ep_mode, packed=plan.packed,
                   devices=str(mesh.devices.flat[0].device_kind), n_layers=spec.n_layers,
                   shard_bytes=plan.attn_shard_bytes, layer_bytes=plan.attn_layer_bytes,
                   tensor_bytes=plan.attn_pack.tensor_bytes(), attn_entries=len(plan.attn_pack.entries),
                   attn_shards=plan.attn_shards,
                   temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
                   xla_options={**mf.xla_options(lay), **opts}, **extra)
        results.append(res)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
