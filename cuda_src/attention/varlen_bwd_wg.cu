// Attention family: the Hopper (wgmma, sm_90a) bwd_dkdv of varlen_bwd_wg.cuh, one unit per element type (built by
// runtime.load_module_sm90a on sm_90 devices; elsewhere it compiles to a stub).
#include "attention/varlen_bwd_wg.cuh"
