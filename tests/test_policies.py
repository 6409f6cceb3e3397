"""The cross-cutting options are policies (issue 44): one object each -- the wire, precision, offload -- taken by a
stage's constructor, as FSDP2's ``fully_shard`` takes ``mp_policy``/``offload_policy``; ``make_stage`` and the
command line keep one option per field and build the objects from the declarations.  Held here: the declaration
and the constructor cannot drift apart (each way of drifting refused), the two spellings build the same stage
(the same bytes, the same parameters, bit for bit), and a bad policy is refused naming the rank."""
from __future__ import annotations

import pytest
import torch

from minizero.comm import Ledger, make_comm
from minizero.compress import WirePolicy
from minizero.course.harness.models import MLP
from minizero.parts.offload import OffloadPolicy
from minizero.stages import STAGES, ZeRO, ZeRO2, make_stage, registry
from minizero.stages.options import (
    COMPRESS,
    ERROR_FEEDBACK,
    FIND_UNUSED_PARAMETERS,
    OFFLOAD_OPTIMIZER,
    PRECISION,
    WIRE_AND_USE,
    check_declared,
    constructor_keywords,
)


# ------------------------------------------------------------------ the declaration is the constructor's
def test_every_stage_of_the_package_declares_its_constructor():
    for stage in STAGES.values():
        check_declared(stage)


def _declared(options, init):
    """A ZeRO stage whose declaration is ``options`` and whose constructor is ``init``."""
    return type("Drifted", (ZeRO,), {"name": "drifted", "options": options, "__init__": init})


def _full(self, module, optimizer=None, comm=None, *, wire=WirePolicy(), find_unused_parameters=False,
          precision="fp32", offload=OffloadPolicy()):
    pass


def _no_offload(self, module, optimizer=None, comm=None, *, wire=WirePolicy(), find_unused_parameters=False,
                precision="fp32"):
    pass


def _wire_fp16(self, module, optimizer=None, comm=None, *, wire=WirePolicy("fp16"), find_unused_parameters=False,
               precision="fp32", offload=OffloadPolicy()):
    pass


def test_a_declaration_that_is_the_constructor_is_taken():
    check_declared(_declared((*WIRE_AND_USE, OFFLOAD_OPTIMIZER), _full))
    check_declared(_declared(WIRE_AND_USE, _no_offload))


@pytest.mark.parametrize("options, init, why", [
    (WIRE_AND_USE, _full, "the constructor takes offload=, undeclared"),
    ((*WIRE_AND_USE, OFFLOAD_OPTIMIZER), _no_offload, "offload_optimizer declared, no offload= taken"),
    ((COMPRESS, FIND_UNUSED_PARAMETERS, PRECISION, OFFLOAD_OPTIMIZER), _full, "half of the wire's fields declared"),
    ((*WIRE_AND_USE, OFFLOAD_OPTIMIZER), _wire_fp16, "the policy's default is not its fields' declared defaults"),
    ((ERROR_FEEDBACK, FIND_UNUSED_PARAMETERS, PRECISION), _no_offload, "no compress: half the wire again"),
])
def test_a_declaration_that_drifts_from_the_constructor_is_refused(options, init, why):
    with pytest.raises(TypeError, match="declares options .* but its constructor takes"):
        registry(_declared(options, init))


# ------------------------------------------------------------------ the options' names build the policies
def test_fields_build_their_policy_and_a_policy_given_whole_passes_on():
    assert constructor_keywords(ZeRO2, {"bucket_mb": 1.0, "compress": "int8", "offload_optimizer": True}) == {
        "bucket_mb": 1.0, "wire": WirePolicy("int8"), "offload": OffloadPolicy(optimizer=True)}
    assert constructor_keywords(ZeRO2, {"error_feedback": True, "compress": "fp16", "precision": "bf16"}) == {
        "wire": WirePolicy("fp16", error_feedback=True), "precision": "bf16"}
    whole = WirePolicy("sign", error_feedback=True)
    assert constructor_keywords(ZeRO2, {"wire": whole}) == {"wire": whole}
    assert constructor_keywords(ZeRO2, {}) == {}  # the constructor's defaults: nothing built here


def test_a_policy_and_its_own_fields_together_are_refused():
    with pytest.raises(TypeError, match=r"give wire= or its fields \['compress'\], not both"):
        constructor_keywords(ZeRO2, {"wire": WirePolicy("fp16"), "compress": "bf16"})


def test_a_policy_on_a_stage_that_takes_none_is_refused():
    model = MLP((4, 4), seed=0)
    with pytest.raises(TypeError, match=r"stage 'ddp' takes no option\(s\) \['offload'\]"):
        make_stage("ddp", model, None, comm=None, offload=OffloadPolicy(optimizer=True))


@pytest.mark.parametrize("of, value, words", [
    (WirePolicy.of, 16, "rank 2: wire must be a WirePolicy or a compress spec such as 'fp16', got 16"),
    (OffloadPolicy.of, "cpu", "rank 2: offload_optimizer must be True or False"),
    (OffloadPolicy.of, OffloadPolicy(optimizer="cpu"), "got 'cpu'; host memory is the only place offered"),
])
def test_a_bad_policy_is_refused_naming_the_rank_and_the_value(of, value, words):
    with pytest.raises(TypeError) as refused:
        of(value, 2)
    assert words in str(refused.value)


def test_a_spec_alone_is_short_for_its_policy():
    assert WirePolicy.of("fp16") == WirePolicy(compress="fp16") and WirePolicy.of(None) == WirePolicy()
    assert OffloadPolicy.of(True) == OffloadPolicy(optimizer=True)


# ------------------------------------------------------------------ the two spellings build the same stage
def _two_steps(me, spelling: str):
    """Two steps of zero2 over an int8 wire with error feedback and the optimizer offloaded, built one way."""
    model = MLP((6, 5, 3), seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    comm = make_comm("ring")
    if spelling == "policies":
        stage = ZeRO2(model, optimizer, comm, bucket_mb=1e-4, wire=WirePolicy("int8", error_feedback=True),
                      offload=OffloadPolicy(optimizer=True))
    elif spelling == "shorthand":
        stage = ZeRO2(model, optimizer, comm, bucket_mb=1e-4, wire="int8", offload=True)
    else:
        stage = make_stage("zero2", model, optimizer, comm, bucket_mb=1e-4, compress="int8", error_feedback=True,
                           offload_optimizer=True)
    ledger = Ledger()
    comm.add_observer(ledger)
    generator = torch.Generator().manual_seed(me.rank)
    for _ in range(2):
        stage.zero_grad()
        stage(torch.randn(4, 6, generator=generator)).square().sum().backward()
        stage.step()
    comm.remove_observer(ledger)
    return ([p.detach().clone() for p in model.parameters()], ledger.snapshot(), stage.wire.error_feedback,
            stage.host_copies is not None)


def test_policies_and_option_names_build_the_same_stage(pools):
    policies, names, shorthand = (pools.run(3, _two_steps, spelling) for spelling in ("policies", "names", "shorthand"))
    for a, b in zip(policies, names, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=True)) and a[1] == b[1]
        assert a[2:] == b[2:] == (True, True)  # error feedback on, the optimizer offloaded: the fields arrived
    assert [r[2:] for r in shorthand] == [(False, True)] * 3  # "int8" alone: no error feedback
    # qgZ; the step's gather; and the ranks' agreement on an inf only one shard holds (compress.overflow): one
    # bitmap of 3 floats all-reduced per step, 2(N-1)/N x 12 bytes on each rank
    assert set(policies[0][1]) == {"all_to_all", "all_gather", "all_reduce"}, policies[0][1]
    assert policies[0][1]["all_reduce"] == 2 * 2 * (3 - 1) / 3 * 12, policies[0][1]
