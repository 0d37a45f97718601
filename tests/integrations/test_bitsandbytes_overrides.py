"""bitsandbytes' per-parameter API (GlobalOptimManager, StableEmbedding) against the real bitsandbytes on CPU.

Each test runs hf_optim's class and bitsandbytes' namesake on identical copies of one model with the same
overrides, and checks both reach the same outcome: which parameters keep fp32 state, which stay put.
"""

import copy

import bitsandbytes as bnb
import pytest
import torch

import hf_optim

PAIRS = [
    (hf_optim.AdamW8bit, bnb.optim.AdamW8bit, dict(lr=1e-2, weight_decay=0.1)),
    (hf_optim.Lion8bit, bnb.optim.Lion8bit, dict(lr=1e-3, weight_decay=0.1)),
    (hf_optim.AdEMAMix8bit, bnb.optim.AdEMAMix8bit, dict(lr=1e-2)),
    (hf_optim.RMSprop8bit, bnb.optim.RMSprop8bit, dict(lr=1e-3)),
]
IDS = [pair[0].__name__ for pair in PAIRS]


@pytest.fixture
def manager():
    """bitsandbytes' global manager, emptied for the test and restored after it."""
    mng = bnb.optim.GlobalOptimManager.get_instance()
    saved = dict(mng.pid2config), dict(mng.index2config), list(mng.module_weight_config_triple)
    mng.initialize()
    yield mng
    mng.initialize()
    mng.pid2config.update(saved[0])
    mng.index2config.update(saved[1])
    mng.module_weight_config_triple.extend(saved[2])


class Net(torch.nn.Module):
    def __init__(self, embedding=None):
        super().__init__()
        self.embedding = embedding
        self.fc0 = torch.nn.Linear(64, 96)  # 6144 weights: 8-bit state unless overridden
        self.fc1 = torch.nn.Linear(96, 64)

    def forward(self, x):
        if self.embedding is not None:
            x = self.embedding(x).mean(dim=1)
        return self.fc1(torch.tanh(self.fc0(x)))


def make_net(embedding=False):
    torch.manual_seed(0)
    return Net(bnb.nn.StableEmbedding(100, 64) if embedding else None)


def train(net, opt, steps=3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        if net.embedding is not None:
            x = torch.randint(0, 100, (4, 5), generator=gen)
        else:
            x = torch.randn(4, 64, generator=gen)
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()


def state_dtypes(net, opt):
    return {name: opt.state[p]["state1"].dtype for name, p in net.named_parameters() if p in opt.state}


def run_both(ours_cls, bnb_cls, kwargs, nets, steps=3):
    """Train hf_optim's class on nets[0] and bitsandbytes' on nets[1] (hf_optim first: bitsandbytes' first step
    writes module overrides into the manager's tables, which hf_optim only reads)."""
    ours, theirs = ours_cls(nets[0].parameters(), **kwargs), bnb_cls(nets[1].parameters(), **kwargs)
    train(nets[0], ours, steps)
    train(nets[1], theirs, steps)
    return ours, theirs


@pytest.mark.parametrize("order", ["register-then-override", "override-then-register"])
@pytest.mark.parametrize("ours_cls,bnb_cls,kwargs", PAIRS, ids=IDS)
def test_optim_bits_override_keeps_fp32_state_like_bitsandbytes(ours_cls, bnb_cls, kwargs, order, manager):
    nets = [make_net(), make_net()]
    for net in nets:
        if order == "register-then-override":  # bitsandbytes' documented order
            manager.register_parameters(net.parameters())
            manager.override_config(net.fc0.weight, "optim_bits", 32)
        else:  # the override is also recorded by position (group 0, index 0)
            manager.override_config(net.fc0.weight, "optim_bits", 32)
            manager.register_parameters(net.parameters())
    ours, theirs = run_both(ours_cls, bnb_cls, kwargs, nets)
    expected = {"fc0.weight": torch.float32, "fc0.bias": torch.float32, "fc1.weight": torch.uint8,
                "fc1.bias": torch.float32}  # the biases are below min_8bit_size
    assert state_dtypes(nets[1], theirs) == expected
    assert state_dtypes(nets[0], ours) == expected


@pytest.mark.parametrize("ours_cls,bnb_cls,kwargs", PAIRS, ids=IDS)
def test_positional_override_applies_to_the_parameter_at_that_place(ours_cls, bnb_cls, kwargs, manager):
    """register_parameters records an earlier override by (group, index): bitsandbytes applies it to whatever
    parameter an optimizer holds there (here copies of the registered model); so does hf_optim."""
    registered = make_net()
    manager.override_config(registered.fc1.weight, "optim_bits", 32)
    manager.register_parameters(registered.parameters())
    nets = [copy.deepcopy(registered), copy.deepcopy(registered)]
    ours, theirs = run_both(ours_cls, bnb_cls, kwargs, nets)
    assert state_dtypes(nets[1], theirs)["fc1.weight"] == torch.float32
    assert state_dtypes(nets[0], ours) == state_dtypes(nets[1], theirs)


@pytest.mark.parametrize("ours_cls,bnb_cls,kwargs", PAIRS, ids=IDS)
def test_lr_override_of_zero_keeps_the_parameter_put_like_bitsandbytes(ours_cls, bnb_cls, kwargs, manager):
    nets = [make_net(), make_net()]
    start = {name: p.detach().clone() for name, p in nets[0].named_parameters()}
    for net in nets:
        manager.register_parameters(net.parameters())
        manager.override_config(net.fc0.weight, "lr", 0.0)
    run_both(ours_cls, bnb_cls, kwargs, nets)
    for net in nets:
        moved = {name for name, p in net.named_parameters() if not torch.equal(p, start[name])}
        assert moved == {"fc0.bias", "fc1.weight", "fc1.bias"}


@pytest.mark.parametrize("ours_cls,bnb_cls,kwargs", PAIRS, ids=IDS)
def test_stable_embedding_keeps_fp32_state_like_bitsandbytes(ours_cls, bnb_cls, kwargs, manager):
    nets = [make_net(embedding=True), make_net(embedding=True)]
    ours, theirs = run_both(ours_cls, bnb_cls, kwargs, nets)
    theirs_dtypes = state_dtypes(nets[1], theirs)
    assert theirs_dtypes["embedding.weight"] == torch.float32 and theirs_dtypes["fc0.weight"] == torch.uint8
    assert state_dtypes(nets[0], ours) == theirs_dtypes


@pytest.mark.parametrize(
    "key,value,error,message",
    [
        ("lr", -1.0, ValueError,
         r"parameter 1 of param group 0, per-parameter override \{'lr': -1.0\}: Invalid learning rate"),
        ("weight_decya", 0.1, ValueError, r"overrides 'weight_decya', which AdamW8bit does not have; did you mean "
                                          r"'weight_decay'\?"),
        ("max_unorm", 1.0, ValueError, r"overrides 'max_unorm', which AdamW8bit does not have \(overridable: betas"),
    ],
    ids=["bad-value", "misspelled", "bitsandbytes-only"],
)
def test_an_override_hf_optim_cannot_honour_refuses_the_step_before_any_update(key, value, error, message, manager):
    net = make_net()
    opt = hf_optim.AdamW8bit(net.parameters(), lr=1e-2)
    train(net, opt, 1)
    before = copy.deepcopy((list(net.parameters()), opt.state_dict()))
    manager.register_parameters(net.parameters())
    manager.override_config(net.fc0.bias, key, value)
    with pytest.raises(error, match=message):
        train(net, opt, 1)
    for p, q in zip(net.parameters(), before[0]):
        assert torch.equal(p, q)
    assert opt.state[net.fc0.weight]["step"] == 1


def test_overrides_are_read_only_from_an_imported_bitsandbytes_and_never_change_its_manager(manager):
    net = make_net()
    manager.register_parameters(net.parameters())
    manager.override_config(net.fc0.weight, "optim_bits", 32)
    tables = copy.deepcopy((manager.pid2config, manager.index2config))
    opt = hf_optim.AdamW8bit(net.parameters())
    train(net, opt, 2)
    assert opt.state[net.fc0.weight]["state1"].dtype == torch.float32  # honoured...
    assert (manager.pid2config, manager.index2config) == tables  # ...by reading only


ON_GPU = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(ON_GPU, reason="GPU machine: the cuda case runs the kernels")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "cls,kwargs",
    [(hf_optim.AdamW8bit, {}), (hf_optim.LAMB8bit, {}), (hf_optim.Lion8bit, {}),
     (hf_optim.Adafactor, {"relative_step": False, "beta1": 0.9, "optim_bits": 8})],
    ids=["AdamW8bit", "LAMB8bit", "Lion8bit", "Adafactor"],
)
def test_overrides_and_a_tensor_lr_reach_the_triton_kernels(cls, kwargs, device, manager, monkeypatch):
    """The same overrides (lr 0 for one weight, another weight decay for another) and a tensor lr, on the Triton
    kernels (Triton's interpreter on CPU) and on the PyTorch path: the same result, fc0.weight put."""
    pytest.importorskip("triton")
    results = []
    for backend in ("torch", "triton"):
        monkeypatch.setenv("HF_OPTIM_BACKEND", backend)
        manager.initialize()
        torch.manual_seed(0)
        net = Net().to(device)
        start = net.fc0.weight.detach().clone()
        manager.register_parameters(net.parameters())
        manager.override_config(net.fc0.weight, "lr", 0.0)
        manager.override_config(net.fc1.weight, "weight_decay", 0.5)
        opt = cls(net.parameters(), lr=torch.tensor(1e-2), **kwargs)
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            opt.zero_grad()
            net(torch.randn(4, 64, generator=gen).to(device)).square().mean().backward()
            opt.step()
        assert torch.equal(net.fc0.weight, start)
        results.append([p.detach().clone() for p in net.parameters()])
    for on_torch, on_triton in zip(*results):
        torch.testing.assert_close(on_triton, on_torch, rtol=1e-5, atol=1e-6)
