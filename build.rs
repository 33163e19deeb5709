//! Names the instruction set the hand-written CPU kernels are compiled
//! for: `avx2_fma` where the target has AVX2 and FMA (x86-64-v3, which
//! `.cargo/config.toml` asks for), so each kernel's `cfg` is one word.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(avx2_fma)");
    println!("cargo::rerun-if-changed=build.rs");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if arch == "x86_64" && has("avx2") && has("fma") {
        println!("cargo::rustc-cfg=avx2_fma");
    }
}
