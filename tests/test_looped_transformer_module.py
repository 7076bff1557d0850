"""The trainable looped linear transformer of Ch. 8 (featlearn.lightning_modules.looped_transformer) and its prompts
(featlearn.datamodules.linear_prompts): the module's O(d^2) loop is the chapter's masked attention (values and
gradients, float64, odd sizes), the construction is alpha x gradient descent, the sampler has its stated
statistics, the Triton loops (interpreter) step as the PyTorch ones, bad values are refused naming the field, and
training learns the task."""
import pytest
import torch

from featlearn.cli import make_cli
from featlearn.datamodules.linear_prompts import LinearPromptDataModule
from featlearn.errors import ConfigError
from featlearn.lightning_modules.looped_transformer import LoopedLinearTransformer
from featlearn.theory.looped_transformer import gd_construction, gradient_descent, looped_attention, prompt_matrix


def _random_model(d, n, loops, step_sizes, seed):
    model = LoopedLinearTransformer(loops=loops, step_sizes=step_sizes, init_scale=0.3, seed=seed)
    model.attach(LinearPromptDataModule(d=d, n=n, batch_size=4)).double()
    with torch.no_grad():  # step sizes that differ per loop, large enough for the loops to matter
        model.log_eta.copy_(torch.log(torch.rand(len(model.log_eta), dtype=torch.float64) * 0.05 + 0.01))
    return model


def _definition(model, batch, loops):
    """The chapter's loop as written: the (n+1) x (n+1) scores, the mask, one loop at a time."""
    Z = prompt_matrix(batch["X"], batch["y"], batch["alpha"])
    for eta in model.step_sizes(loops):
        Z = looped_attention(Z, model.Q, model.P, eta.expand(len(Z)), 1)
    return -Z[:, -1, :model.d]


@pytest.mark.parametrize("d, n, loops, step_sizes", [(3, 7, 5, "per_loop"), (4, 16, 9, "shared"), (5, 11, 3, "per_loop")])
def test_the_loop_is_the_chapters_masked_attention_values_and_gradients(d, n, loops, step_sizes):
    torch.manual_seed(d * 100 + n)
    model = _random_model(d, n, loops, step_sizes, seed=d)
    batch = {k: v.double() for k, v in LinearPromptDataModule(d=d, n=n, seed=n, batch_size=6)
             .batch(torch.arange(6) + 11, "train").items()}
    for count in (loops, 2 * loops + 1):  # past the learned loops: the last step size again
        fast, slow = model(batch, count), _definition(model, batch, count)
        torch.testing.assert_close(fast, slow, rtol=1e-11, atol=1e-13)
        weights = (model.Q, model.P, model.log_eta)
        g_fast = torch.autograd.grad((fast * batch["theta"]).sum(), weights)
        g_slow = torch.autograd.grad((slow * batch["theta"]).sum(), weights)
        for a, b in zip(g_fast, g_slow):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("d, n", [(2, 5), (4, 16), (7, 9)])
def test_the_construction_is_alpha_times_gradient_descent(d, n):
    model = LoopedLinearTransformer(loops=13, step_sizes="shared", init="construction")
    model.attach(LinearPromptDataModule(d=d, n=n, seed=d + n, batch_size=5)).double()
    Q, P = gd_construction(d)
    assert torch.equal(model.Q, Q) and torch.equal(model.P, P) and model.construction_cosine() == pytest.approx(1.0)
    prompts = LinearPromptDataModule(d=d, n=n, seed=d + n).batch(torch.arange(5), "val")
    batch = {k: v.double() for k, v in prompts.items()}
    eta = float(model.step_sizes(1)[0].detach())
    gd = gradient_descent(batch["X"], batch["y"], torch.full((5,), eta, dtype=torch.float64), 13)[-1]
    torch.testing.assert_close(model(batch), batch["alpha"][:, None] * gd, rtol=1e-12, atol=1e-14)


def test_prompts_have_their_stated_statistics():
    dm = LinearPromptDataModule(d=4, n=16, alpha_low=0.5, alpha_high=2.0, seed=3, batch_size=8)
    b = dm.batch(torch.arange(20000), "train")
    assert torch.allclose(b["theta"].norm(dim=-1), torch.ones(20000), atol=1e-6)
    x = b["X"].flatten()
    assert abs(float(x.mean())) < 0.005 and abs(float(x.var()) - 1) < 0.01          # 1.3M values: se ~ 0.001
    theta = b["theta"].double()  # uniform on the sphere: E theta theta^T = I / d
    torch.testing.assert_close(theta.T @ theta / 20000, torch.eye(4, dtype=torch.float64) / 4, rtol=0, atol=0.01)
    a = b["alpha"].double()
    assert 0.5 <= float(a.min()) and float(a.max()) < 2.0
    assert abs(float(a.mean()) - 1.25) < 0.01 and abs(float(a.var()) - 1.5 ** 2 / 12) < 0.01
    torch.testing.assert_close(b["y"], (b["X"] @ b["theta"].unsqueeze(-1)).squeeze(-1))
    again = dm.batch(torch.arange(20000)[[7, 19999]], "train")  # a prompt is a function of (seed, index)
    assert torch.equal(again["X"], b["X"][[7, 19999]])
    other = LinearPromptDataModule(d=4, n=16, seed=4).batch(torch.arange(3), "train")
    assert not torch.equal(other["theta"], b["theta"][:3])


def test_a_triton_step_is_the_torch_step(poisoned):
    """backend="triton" (the fused kernels, here through the interpreter) against "torch" in float32: the loss, its
    gradients, one Adam step and the validation's loop counts (past the learned loops too)."""
    dm = LinearPromptDataModule(d=3, n=7, batch_size=5, seed=2)
    models = [LoopedLinearTransformer(loops=4, init_scale=0.3, backend=backend, seed=1).attach(dm)
              for backend in ("torch", "triton")]
    assert [m.op_backend() for m in models] == ["torch", "triton"]
    assert [m.seeds_vmap for m in models] == [True, False]  # the kernels have no vmap rule: seeds step in turn
    batch = dm.batch(torch.arange(5) + 3, "train")
    losses, grads = [], []
    for model in models:
        with torch.no_grad():
            model.log_eta.copy_(torch.log(torch.tensor([0.05, 0.1, 0.02, 0.08])))
        optimizer = model.configure_optimizers()
        loss = model.training_step(batch, 0)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in (model.Q, model.P, model.log_eta)])
        optimizer.step()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-7)
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    with torch.no_grad():
        outs = [m.outputs(batch, [0, 4, 8, 16]) for m in models]
    for L in (0, 4, 8, 16):
        torch.testing.assert_close(outs[1][L], outs[0][L], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build, field", [
    (lambda: LinearPromptDataModule(d=5, n=4), "data.n"),
    (lambda: LinearPromptDataModule(alpha_low=2.0, alpha_high=1.0), "data.alpha_high"),
    (lambda: LinearPromptDataModule(alpha_low=0.0), "data.alpha_low"),
    (lambda: LoopedLinearTransformer(loops=0), "model.loops"),
    (lambda: LoopedLinearTransformer(eval_loops=[]), "model.eval_loops"),
    (lambda: LoopedLinearTransformer(eval_loops=[3, 0]), "model.eval_loops"),
    (lambda: LoopedLinearTransformer(init_scale=-0.1), "model.init_scale"),
    (lambda: LoopedLinearTransformer(step_sizes="each"), "model.step_sizes"),
    (lambda: LoopedLinearTransformer(backend="cuda"), "model.backend"),
    (lambda: LoopedLinearTransformer(backend="triton").attach(LinearPromptDataModule(d=64, n=64)), "model.backend"),
])
def test_bad_values_are_refused_naming_the_field(build, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        build()


def _trained(tmp_path, objective: str) -> dict:
    cli = make_cli(["fit", "--config", "configs/looped_transformer/trained.yaml", "--model.init_args.loops", "5",
                    "--model.init_args.objective", objective, "--trainer.max_steps", "1500",
                    "--trainer.val_check_interval", "1500", "--trainer.logger.init_args.save_dir", str(tmp_path),
                    "--trainer.enable_progress_bar", "false", "--heatmap.every_n_steps", "1500"])
    return cli.model.final_metrics()


def test_the_chapters_task_is_learned_without_gradient_descent_and_the_vector_target_learns_it(tmp_path, one_thread):
    """Headline (d = 4, n = 16, 5 loops, 1500 Adam steps from a random start; the experiment's 3000 steps on
    seeds 0-2 give the ranges quoted). On the chapter's task (only <TF, theta*> = alpha is asked) the loop does not
    become gradient descent: its output stays far from alpha theta* (distance 0.64-0.68), its weights far from the
    construction (cosine 0.29-0.62). Asked for alpha theta*, it recovers the construction up to scale (cosine
    0.81-0.90), beats gradient descent at T, yet falls behind it past T (a fixed step size, not 1 / lambda_max)."""
    inner = _trained(tmp_path, "inner")
    assert inner["vector_error_loops5"] > 0.4 and inner["construction_cosine"] < 0.7, inner
    vector = _trained(tmp_path, "vector")
    assert vector["construction_cosine"] > 0.75, vector
    assert vector["vector_error_loops5"] < 0.95 * vector["gd_vector_error_loops5"], vector  # 0.103-0.106 vs 0.13
    assert vector["error_loops20"] > 1.5 * vector["gd_error_loops20"], vector              # 0.013-0.024 vs 0.0048
