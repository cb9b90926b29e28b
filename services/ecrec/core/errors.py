"""The core's error for a request it refuses: one type, so that the adapters (servicers, the store) can turn
every refusal into INVALID_ARGUMENT however deep in the core it was raised. No imports: any module may use it
(the spec too, which must not import torch); so may the reason a spec with r = 2 and the sum code is refused.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request that is malformed or asks for something this server does not hold."""


# Why `sum` has no r = 2 form: a second float parity must weigh the members differently (Q = Σ c_i·D_i), and two
# lost members then come back from a 2×2 Vandermonde solve, D_x = (S_q − c_y·S_p) / (c_x − c_y). Its
# cancellation turns the rounding of the sums over the other members into an error that nothing about D_x
# bounds (it grows with their magnitudes and the weights), and no float construction is bit-exact.
SUM_HAS_NO_R2 = (
    "code 'sum' has no r = 2 form: a float Q needs a Vandermonde solve to give two lost members back, whose "
    "rounding error is unbounded (no bit-exact float construction); use code 'xor' (P + Q over GF(2^8))"
)
