"""`mapper_type="ridge"`: the paper's closed-form centered ridge map, the base every other mapper starts from.

The fit is `KVMapper.from_statistics` (`hf_kvbridge.fitting.solve.solve_ridge` per target layer and head group), which
`calibrate` always runs; this entry adds nothing on top of it.
"""

from .base import KVMapper, MapperType

MAPPER = MapperType(
    "ridge", KVMapper, fit=None, linear=True, description="centered ridge per target layer (the paper's map)"
)
