"""The torch_xla gateway: the only room that imports torch_xla, always inside a function, so
`import xla_wrap` works without it. A tensor can only live on an XLA device once torch_xla is
loaded, so every question about XLA is answered from `sys.modules`.

rng: the seeds (replayed for a recomputation, kept true across steps); runtime: questions about
lazy tensors and the runtime; sharding: SPMD annotations; lowering: barriers and host placement
in the program; path: the XLA execution path the core asks (xla_wrap/_paths/base.py).
"""

from . import rng as rng
from .lowering import BARRIER_STRIPPING_PASS as BARRIER_STRIPPING_PASS
from .lowering import KEEP_BARRIERS_FLAG as KEEP_BARRIERS_FLAG
from .lowering import annotating_offload_on_any_backend as annotating_offload_on_any_backend
from .lowering import barrier_stripping_active as barrier_stripping_active
from .lowering import barriered as barriered
from .lowering import barriers_stripped_here as barriers_stripped_here
from .lowering import host_offload_supported as host_offload_supported
from .lowering import place_to_device as place_to_device
from .lowering import place_to_host as place_to_host
from .path import XLA as XLA
from .path import XlaPath as XlaPath
from .path import note_output_sharding as note_output_sharding
from .rng import SEED_MASK as SEED_MASK
from .rng import StepBaseSeed as StepBaseSeed
from .rng import add_step_closure as add_step_closure
from .rng import advance_seed as advance_seed
from .rng import call_seed as call_seed
from .rng import keep_stream as keep_stream
from .rng import next_step_seed as next_step_seed
from .rng import rng_state as rng_state
from .rng import set_rng_state as set_rng_state
from .runtime import checkpoint_backward_status as checkpoint_backward_status
from .runtime import in_gradient_accumulation_loop as in_gradient_accumulation_loop
from .runtime import installed as installed
from .runtime import ir_text as ir_text
from .runtime import is_device_data as is_device_data
from .runtime import is_xla_tensor as is_xla_tensor
from .runtime import layer_slice_ops as layer_slice_ops
from .runtime import loaded as loaded
from .runtime import pending_hlo_text as pending_hlo_text
from .runtime import refusing_cpu_fallbacks as refusing_cpu_fallbacks
from .runtime import runtime_started as runtime_started
from .runtime import spmd_active as spmd_active
from .runtime import sync as sync
from .runtime import tensor_id as tensor_id
from .runtime import while_loop as while_loop
from .runtime import xla_devices as xla_devices
from .runtime import xla_fsdp_class as xla_fsdp_class
from .sharding import shard_by_spec as shard_by_spec
from .sharding import shard_like as shard_like
from .sharding import sharding as sharding
from .sharding import sharding_spec as sharding_spec
from .sharding import tiled_sharding as tiled_sharding
from .sharding import warn_unsharded_gradient_once as warn_unsharded_gradient_once
