//! Names the instruction set the hand-written CPU kernels are compiled
//! for: `avx2_fma` where the target has AVX2 and FMA (x86-64-v3, which
//! `.cargo/config.toml` asks for), so each kernel's `cfg` is one word; and
//! joins the GPU kernel sources into the one program both GPU runtimes
//! build.

use std::path::Path;

fn main() {
    println!("cargo::rustc-check-cfg=cfg(avx2_fma)");
    println!("cargo::rerun-if-changed=build.rs");
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let features = std::env::var("CARGO_CFG_TARGET_FEATURE").unwrap_or_default();
    let has = |f: &str| features.split(',').any(|x| x == f);
    if arch == "x86_64" && has("avx2") && has("fma") {
        println!("cargo::rustc-cfg=avx2_fma");
    }
    gpu_program(Path::new("src/backend/kernels"));
}

/// `$OUT_DIR/program.cu`: `dir`'s `prelude.h`, then each `.cu` file of
/// `dir` in name order, each from a new line. A kernel's source is in the
/// program by being in `dir`.
fn gpu_program(dir: &Path) {
    println!("cargo::rerun-if-changed={}", dir.display());
    let read = |p: &Path| {
        std::fs::read_to_string(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display()))
    };
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut sources: Vec<_> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    let mut program = read(&dir.join("prelude.h"));
    for source in &sources {
        program.push('\n');
        program.push_str(&read(source));
    }
    let out = Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("program.cu");
    std::fs::write(&out, program).unwrap_or_else(|e| panic!("writing {}: {e}", out.display()));
}
