"""Session 47: edits that matter only where the expert count is not a power of two (the
expert table padded to E_P > E), each run against conformance's experts_64 case and its new
experts_60 case on the ROCm backend (its Triton align step interpreted on the CPU).

    TRITON_INTERPRET=1 python tools/conformance_mutants.py docs/device-runs/2026-11-27-session47/mutants_experts60.py
"""

from conformance_mutants import Mutant

F = "core/kernels/triton_fused_moe.py"
ROCM = ["moehal", "conformance", "--backend", "rocm", "-k"]
EDITS = [
    (
        "align-owner-unmasked",
        "owner = tl.sum(((ends[None, :] <= p[:, None]) & (ce[None, :] < E)).to(tl.int32), axis=1)",
        "owner = tl.sum((ends[None, :] <= p[:, None]).to(tl.int32), axis=1)",
        "the align step counts the padded table entries past E as segments ending before p",
    ),
    (
        "align-table-unpadded",
        "e_p = next_power_of_2(e)",
        "e_p = e",
        "the align step's expert table is E wide, not padded to a power of two",
    ),
    (
        "align-counts-past-e",
        "cnt = tl.load(counts_ptr + ce, mask=ce < E, other=0)",
        "cnt = tl.load(counts_ptr + ce, mask=ce < E_P, other=0)",
        "the align step reads E_P expert counts where E are written",
    ),
]
MUTANTS = [
    Mutant(f"{name}@{case}", F, old, new, why, ROCM + [case])
    for name, old, new, why in EDITS
    for case in ("experts_64", "experts_60")
]
# The same edit's out-of-bounds read, run again: lanes past E read memory beyond the counts
# tensor, so whether the case fails depends on what that memory holds in the run.
MUTANTS += [
    Mutant(f"align-counts-past-e@experts_60#{n}", F, old, new, why, ROCM + ["experts_60"])
    for name, old, new, why in EDITS
    if name == "align-counts-past-e"
    for n in (2, 3, 4)
]
