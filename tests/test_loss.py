"""train.loss: chunked and chunked_recompute equal the standard loss (value, gradients of the hidden
states and the head weight, whole models of every factor kind, a trainer's loss curve, 2-process
DDP and FSDP2), their own memory falls by more than 80% at 8,192 tokens x 32,000, and `loss_bytes`
predicts what is measured."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from _common import ROOT
from distributed_helpers import COMMON, final, rel_diff, run_worker_pair

from effpretrain.config import ConfigError, load_config
from effpretrain.data import IGNORE_INDEX
from effpretrain.loss import linear_cross_entropy, loss_bytes, token_loss_sum
from effpretrain.memory import accounting, measure_loss_bytes

CHUNKED = ["chunked", "chunked_recompute"]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))  # 0 when both are zero (a LoRA A)


def loss_and_grads(kind: str, h, w, labels, chunk: int = 1) -> tuple[torch.Tensor, ...]:
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    if kind == "reference":
        s = F.cross_entropy(h @ w.t(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    else:
        s = linear_cross_entropy(h, w, labels, kind, chunk)
    s.backward(torch.tensor(0.75))  # a scaled upstream gradient, as the trainer's 1 / n_targets
    return s.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk", [1, 97, 256, 5000])
@pytest.mark.parametrize("kind", CHUNKED)
def test_chunked_equals_standard_and_torch_with_padded_rows(kind, chunk):
    g = torch.Generator().manual_seed(0)
    n, v, hidden = 600, 1000, 48
    h = torch.randn(n, hidden, generator=g)
    w = torch.randn(v, hidden, generator=g) * 0.2
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::7] = IGNORE_INDEX
    labels[100:160] = IGNORE_INDEX  # a padded tail of a row
    ref = loss_and_grads("reference", h, w, labels)
    std = loss_and_grads("standard", h, w, labels)
    got = loss_and_grads(kind, h, w, labels, chunk)
    for a, b in zip(std, ref):
        assert rel(a, b) <= 1e-6
    for a, b in zip(got, ref):  # value, dH, dW
        assert rel(a, b) <= 1e-6
    # Unlabelled rows contribute nothing: their hidden-state gradient is exactly zero.
    assert torch.all(got[1][labels == IGNORE_INDEX] == 0)


@pytest.mark.parametrize("kind", CHUNKED)
def test_chunked_with_no_labelled_row_is_zero(kind):
    h = torch.randn(8, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    s = linear_cross_entropy(h, w, torch.full((8,), IGNORE_INDEX), kind, 3)
    s.backward()
    assert s.item() == 0 and not h.grad.any() and not w.grad.any()


@pytest.mark.parametrize("kind", CHUNKED)
def test_chunked_under_bf16_autocast_matches_standard(kind):
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(300, 32, generator=g), torch.randn(500, 32, generator=g) * 0.2
    labels = torch.randint(0, 500, (300,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        std = loss_and_grads("standard", h, w, labels)
        got = loss_and_grads(kind, h, w, labels, 64)
    # Both products run in bf16 (the head's autocast dtype); reductions are fp32.
    assert got[2].dtype == torch.float32 and got[1].dtype == torch.float32
    for a, b in zip(got, std):
        assert rel(a, b) <= 2e-2


@pytest.mark.parametrize("kind", CHUNKED)
def test_chunked_without_gradients_computes_the_loss_alone(kind):
    """Evaluation (no-grad) and inputs that need no gradient: the same value, no graph, and none of
    the (N, h) + (V, h) gradient buffers that the training form holds."""
    g = torch.Generator().manual_seed(2)
    n, v, hidden = 400, 900, 40
    h = torch.randn(n, hidden, generator=g, requires_grad=True)
    w = torch.randn(v, hidden, generator=g, requires_grad=True)
    labels = torch.randint(0, v, (n,), generator=g)
    want = F.cross_entropy(h @ w.t(), labels, reduction="sum").detach()
    with torch.no_grad(), accounting(h, w, labels) as log:  # chunks of 10 rows: 4 x 10 x V bytes of logits
        s = linear_cross_entropy(h, w, labels, kind, 10)
    assert s.grad_fn is None and rel(s, want) <= 1e-6
    assert log.replay(include_existing=False)[0] < 4 * (n + v) * hidden  # less than dH + dW alone
    s = linear_cross_entropy(h.detach(), w.detach(), labels, kind, 100)
    assert s.grad_fn is None and rel(s, want) <= 1e-6


@pytest.mark.parametrize("kind", CHUNKED)
def test_chunked_gradient_of_the_hidden_states_alone(kind):
    """A frozen head: only dH, equal to the reference's."""
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(50, 8, generator=g), torch.randn(70, 8, generator=g)
    labels = torch.randint(0, 70, (50,), generator=g)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    F.cross_entropy(h1 @ w.t(), labels, reduction="sum").backward(torch.tensor(0.5))
    linear_cross_entropy(h2, w, labels, kind, 16).backward(torch.tensor(0.5))
    assert rel(h2.grad, h1.grad) <= 1e-6 and w.grad is None


def test_chunked_second_backward_through_the_same_graph_fails_loudly():
    """The saved dH and dW are scaled in place by the backward: a second backward (retain_graph)
    is refused by autograd's version check rather than returning twice-scaled gradients."""
    h = torch.randn(20, 6, requires_grad=True)
    w = torch.randn(30, 6, requires_grad=True)
    s = linear_cross_entropy(h, w, torch.randint(0, 30, (20,)), "chunked", 8)
    s.backward(torch.tensor(0.5), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        s.backward(torch.tensor(0.5))


def model_grads(kind: str | None, loss: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from effpretrain.models import apply_factorization, build_model

    model = build_model("tiny", 512, 32, seed=0)
    if kind:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)  # some kinds draw their factors from the global generator
            apply_factorization(model, kind, 8, 2.0, density=0.05)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (3, 16), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0  # a right-padded row, as data.mode=truncate makes
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    s, c = token_loss_sum(
        model, {"input_ids": ids, "attention_mask": mask, "labels": labels}, loss=loss, chunk_tokens=7
    )
    (s / c).backward()
    assert "forward" not in vars(model.lm_head)  # the head's own forward is back
    return s.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _factor_kinds() -> list[str | None]:
    from effpretrain.models import FACTOR_KINDS

    return [None, *FACTOR_KINDS]


@pytest.mark.parametrize("loss", CHUNKED)
@pytest.mark.parametrize("kind", _factor_kinds())
def test_token_loss_sum_chunked_equals_standard_on_every_model_kind(kind, loss):
    s_std, g_std = model_grads(kind, "standard")
    s_chk, g_chk = model_grads(kind, loss)
    assert abs(s_chk - s_std) <= 1e-6 * abs(s_std)
    assert g_std.keys() == g_chk.keys() and "lm_head.weight" in g_std
    for name in g_std:
        assert rel(g_chk[name], g_std[name]) <= 1e-5, name


def test_config_validates_the_loss():
    cfg = load_config(None, ["train.loss=chunked", "train.loss_chunk_tokens=512"])
    assert cfg.train.loss == "chunked" and cfg.train.loss_chunk_tokens == 512
    assert load_config(None, ["train.loss=chunked_recompute"]).train.loss == "chunked_recompute"
    with pytest.raises(ConfigError, match="train.loss"):
        load_config(None, ["train.loss=fused"])
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        load_config(None, ["train.loss_chunk_tokens=0"])


@pytest.mark.run
def test_trainer_loss_curve_is_the_same_with_chunked_loss(tmp_path, tiny_overrides):
    """Padded rows (truncate), accumulation and a chunk smaller than a micro-batch's rows."""
    from effpretrain.trainer import train

    over = tiny_overrides + [
        "train.max_steps=8",
        "train.log_every=1",
        "train.eval_every=4",
        "train.batch_size=2",
        "train.grad_accum=2",
        "data.mode=truncate",
        "data.shuffle_buffer=16",  # truncate fills the buffer one document a row: keep it small
        "train.loss_chunk_tokens=40",
    ]
    recipe = ROOT / "recipes" / "tiny" / "adamw.yaml"
    curves, summaries = {}, {}
    for loss in ("standard", *CHUNKED):
        summaries[loss] = train(load_config(recipe, over + [f"train.loss={loss}"]), tmp_path / loss)
        lines = (tmp_path / loss / "metrics.jsonl").read_text().splitlines()
        curves[loss] = [e["loss"] for e in map(json.loads, lines) if "event" not in e]
    assert len(curves["standard"]) == 8
    for loss in CHUNKED:
        for a, b in zip(curves[loss], curves["standard"], strict=True):
            assert abs(a - b) <= 1e-5 * abs(b), loss
        a, b = summaries[loss]["final_val_loss"], summaries["standard"]["final_val_loss"]
        assert abs(a - b) <= 1e-5 * abs(b), loss


@pytest.mark.run
def test_chunked_loss_memory_drop_at_8192_tokens_and_loss_bytes():
    """Acceptance: at 8,192 tokens, vocabulary 32,000, hidden 256, fp32, the loss's own measured peak
    (its logits, what it saves for backward, transients, its gradients) falls by at least 80%."""
    shape = (8192, 32000, 256)
    std = measure_loss_bytes("standard", *shape)
    chk = measure_loss_bytes("chunked", *shape, chunk_tokens=1024)
    rec = measure_loss_bytes("chunked_recompute", *shape, chunk_tokens=1024)
    assert std["peak"] > 3 * 8192 * 32000 * 4  # three (N, V) fp32 blocks at once in the backward
    assert chk["peak"] <= 0.2 * std["peak"] and rec["peak"] <= 0.2 * std["peak"]
    assert chk["saved"] == (8192 + 32000) * 256 * 4  # dH and dW (fp32), from forward to backward
    assert rec["saved"] == 8192 * 4  # one fp32 logsumexp per token
    for kind, got in (("standard", std), ("chunked", chk), ("chunked_recompute", rec)):
        want = loss_bytes(kind, *shape, torch.float32, 1024)
        assert got["saved"] == want["saved"], kind
        assert abs(got["transient"] - want["transient"]) <= 0.1 * want["transient"], kind


@pytest.mark.parametrize(
    ("dtype", "params"),
    [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)],
    ids=["fp32", "bf16-mixed", "bf16-pure"],
)
@pytest.mark.parametrize("chunk", [128, 700, 4096])
@pytest.mark.parametrize("kind", ["standard", *CHUNKED])
def test_loss_bytes_matches_measurement(kind, chunk, dtype, params):
    """bf16-mixed: H and W fp32, the products in bf16 under autocast (on copies); bf16-pure: H and
    W bf16, no copies, dH in bf16 and dW cast to bf16 at the end of the backward."""
    n, v, hidden, every = 1500, 3000, 96, 6
    got = measure_loss_bytes(kind, n, v, hidden, dtype, chunk, ignored_every=every, param_dtype=params)
    want = loss_bytes(
        kind, n, v, hidden, dtype, chunk, targets=n - len(range(0, n, every)), param_dtype=params
    )
    assert got["saved"] == want["saved"]
    assert abs(got["transient"] - want["transient"]) <= 0.1 * want["transient"]
    assert want["peak"] == want["saved"] + want["transient"]


@pytest.mark.parametrize("params", [torch.float32, torch.bfloat16], ids=["bf16-mixed", "bf16-pure"])
def test_bf16_chunked_loss_with_a_vocabulary_of_several_dw_blocks(params):
    """A vocabulary of several `dw_block_rows` blocks (30,000 rows, 4,096 a block): the loss's
    measured transient is the formula's, whose dW product term is one (B, h) block, not (V, h).
    In bf16-pure the backward's cast of the fp32 dW to the weight's dtype is then the peak."""
    from effpretrain.loss import dw_block_rows

    n, v, hidden, chunk = 64, 30000, 256, 16
    assert dw_block_rows(chunk, v) == 4096
    got = measure_loss_bytes("chunked", n, v, hidden, torch.bfloat16, chunk, param_dtype=params)
    want = loss_bytes("chunked", n, v, hidden, torch.bfloat16, chunk, param_dtype=params)
    assert abs(got["transient"] - want["transient"]) <= 0.1 * want["transient"]
    if params == torch.bfloat16:
        assert want["backward"] == 2 * v * hidden > want["forward"]


# 2-process parity with the chunked loss: the head's forward runs inside DDP's and FSDP2's forward.
# recipe -> (2-process overrides, 1-process reference): the reference runs the ranks' micro-batches
# in the order whose sums match the ranks' (as in test_distributed / test_fsdp2), so that the
# refactorization SVD of lowrank_restarts sees the same inputs; adamw also accumulates.
PARITY = {
    "adamw": (["train.batch_size=1", "train.grad_accum=2"], ["train.batch_size=1", "train.grad_accum=4"]),
    "lowrank_restarts": (["train.batch_size=2"], ["train.batch_size=2", "train.grad_accum=2"]),
}
WORKER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from effpretrain.config import load_config
    from effpretrain.trainer import train

    root, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    cases, common = json.loads(sys.argv[4]), sys.argv[5:]
    common = common + ["train.loss=chunked", "train.loss_chunk_tokens=24"]
    recipe = lambda m: root / "recipes" / "tiny" / f"{m}.yaml"
    for m, (two, one) in cases.items():
        if mode == "one":
            train(load_config(recipe(m), common + one), out / f"{m}-1p")
            continue
        for sharding in ("ddp", "fsdp2"):
            train(load_config(recipe(m), common + two + [f"dist.sharding={sharding}"]), out / f"{m}-{sharding}")
    """
)


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("chunked_dist")
    run_worker_pair(WORKER, out, [json.dumps(PARITY), *COMMON])
    return out


@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
@pytest.mark.parametrize("method", list(PARITY))
@pytest.mark.multiprocess
def test_chunked_loss_two_processes_equal_one_process(method, sharding, parity_runs):
    one = json.loads((parity_runs / f"{method}-1p" / "summary.json").read_text())
    two = json.loads((parity_runs / f"{method}-{sharding}" / "summary.json").read_text())
    assert two["world_size"] == 2 and one["world_size"] == 1 and two["tokens"] == one["tokens"]
    assert abs(two["final_val_loss"] - one["final_val_loss"]) <= 1e-5 * abs(one["final_val_loss"])
    assert rel_diff(final(parity_runs / f"{method}-{sharding}"), final(parity_runs / f"{method}-1p")) <= 1e-5
