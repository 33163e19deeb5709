// AdamW (torch.optim.AdamW, decoupled weight decay) over n parameters, one
// thread each. The host folds the step's constants: step_size = lr / (1 -
// beta1^step), decay = 1 - lr * weight_decay, bc2_sqrt = sqrt(1 - beta2^step).
// With has_copy, each new value is also stored rounded to bf16 in copy (the
// weights' bf16 copy under --precision bf16); without, copy is not touched.
KERNEL void adamw(GLOBAL float* RESTRICT param, unsigned param_off,
                  const GLOBAL float* RESTRICT grad, unsigned grad_off,
                  GLOBAL float* RESTRICT m, unsigned m_off,
                  GLOBAL float* RESTRICT v, unsigned v_off, unsigned n,
                  float beta1, float beta2, float eps, float step_size, float decay,
                  float bc2_sqrt, float grad_scale,
                  GLOBAL unsigned short* copy, unsigned copy_off, unsigned has_copy) {
    idx_t i = GLOBAL_ID(0);
    if (i >= n) return;
    float g = grad[grad_off + i] * grad_scale;
    float mi = beta1 * m[m_off + i] + (1.0f - beta1) * g;
    float vi = beta2 * v[v_off + i] + (1.0f - beta2) * g * g;
    m[m_off + i] = mi;
    v[v_off + i] = vi;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    float p = param[param_off + i] * decay - step_size * mi / denom;
    param[param_off + i] = p;
    if (has_copy) copy[copy_off + i] = (unsigned short)(bf16_round_bits(p) >> 16);
}
