"""The optional Muon inner optimizer: which parameters it owns, that it trains, and its config."""

import pytest
import torch

from node.training.config import InnerConfig, TrainConfig
from node.training.model import ModelConfig, build_model
from node.training.trainer import Trainer, muon_params
from protocols.errors import ConfigError

CONFIG = ModelConfig(d_model=32, n_layer=2, n_head=2, seq_len=16)


def test_muon_owns_the_linear_weights_and_adamw_the_rest():
    model = build_model(CONFIG, seed=0)
    names = {id(p): n for n, p in model.named_parameters()}
    owned = {names[id(p)] for p in muon_params(model)}
    linear = {n for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith(("tok_emb", "pos_emb"))}
    assert owned == linear and owned  # qkv, proj, fc weights of every block
    trainer = Trainer(model, InnerConfig(optimizer="muon"), TrainConfig(), torch.device("cpu"))
    muon, adamw = trainer.optimizers[1], trainer.optimizers[0]
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    in_adamw = {id(p) for g in adamw.param_groups for p in g["params"]}
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    assert not in_adamw & in_muon and in_adamw | in_muon == {id(p) for p in model.parameters()}
    assert id(model.tok_emb.weight) in in_adamw  # the embedding (and the head tied to it)


def test_muon_trains_and_takes_other_steps_than_adamw():
    batch = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(0))
    losses, weights = {}, {}
    for optimizer in ("adamw", "muon"):
        trainer = Trainer(build_model(CONFIG, seed=0), InnerConfig(optimizer=optimizer), TrainConfig(),
                          torch.device("cpu"))
        first = float(trainer.inner_step(batch[:, :-1], batch[:, 1:], lr=3e-3))
        for _ in range(20):
            last = float(trainer.inner_step(batch[:, :-1], batch[:, 1:], lr=3e-3))
        losses[optimizer] = (first, last)
        weights[optimizer] = trainer.model.blocks[0].mlp.fc.weight.detach().clone()
        assert all(p.grad is None for p in trainer.model.parameters())  # every optimizer's grads cleared
    assert losses["muon"][1] < 0.8 * losses["muon"][0]
    assert not torch.allclose(weights["adamw"], weights["muon"])


@pytest.mark.parametrize("field, value, match", [("optimizer", "sgd", "inner.optimizer"),
                                                 ("muon_momentum", 1.0, "inner.muon_momentum")])
def test_a_bad_inner_optimizer_is_a_one_line_error(field, value, match):
    with pytest.raises(ConfigError, match=match):
        InnerConfig(**{field: value})
