//! Finding CUDA's libraries where users have them: on the loader's path,
//! under `$CUDA_HOME` or `/usr/local/cuda`, or in the `nvidia-*-cu12` wheels
//! pip installs (`site-packages/nvidia/<name>/lib`, of the active virtual or
//! conda environment, the user's site and the system's). A library found off
//! the loader's path is opened here by its full path before cudarc asks for
//! it by name; the dynamic loader then hands cudarc the copy already loaded.

use libloading::Library;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The libraries cudarc opens by name, in dependency order (NVRTC opens its
/// builtins, cuBLAS needs cuBLASLt).
const WANTED: [&str; 5] = [
    "libnvrtc-builtins.so.12",
    "libnvrtc.so.12",
    "libcublasLt.so.12",
    "libcublas.so.12",
    "libnccl.so.2",
];

/// Folders that may hold CUDA's libraries, most specific first.
pub(super) fn search_dirs() -> Vec<PathBuf> {
    let env = |k: &str| std::env::var_os(k).map(PathBuf::from);
    let mut dirs = Vec::new();
    for home in [env("CUDA_HOME"), env("CUDA_PATH")].into_iter().flatten() {
        dirs.push(home.join("lib64"));
        dirs.push(home.join("lib"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    let mut prefixes: Vec<PathBuf> = [env("VIRTUAL_ENV"), env("CONDA_PREFIX")]
        .into_iter()
        .flatten()
        .collect();
    if let Some(home) = env("HOME") {
        prefixes.push(home.join(".local"));
    }
    prefixes.extend(["/usr/local", "/usr"].map(PathBuf::from));
    for prefix in prefixes {
        for site in site_packages(&prefix) {
            let Ok(entries) = std::fs::read_dir(site.join("nvidia")) else {
                continue;
            };
            let mut libs: Vec<PathBuf> = entries
                .flatten()
                .map(|e| e.path().join("lib"))
                .filter(|p| p.is_dir())
                .collect();
            libs.sort();
            dirs.extend(libs);
        }
    }
    dirs
}

/// `prefix/lib*/python3*/{site,dist}-packages` folders that exist.
fn site_packages(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for lib in ["lib", "lib64"] {
        let Ok(entries) = std::fs::read_dir(prefix.join(lib)) else {
            continue;
        };
        let mut pythons: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        pythons.sort();
        for py in pythons {
            for sub in ["site-packages", "dist-packages"] {
                if py.join(sub).is_dir() {
                    out.push(py.join(sub));
                }
            }
        }
    }
    out
}

/// The first file in `dirs` whose name is `soname` or starts with
/// `soname.` (a fuller version, as NVRTC's builtins carry).
fn find(dirs: &[PathBuf], soname: &str) -> Option<PathBuf> {
    dirs.iter().find_map(|d| {
        let exact = d.join(soname);
        if exact.is_file() {
            return Some(exact);
        }
        let mut versioned: Vec<PathBuf> = std::fs::read_dir(d)
            .ok()?
            .flatten()
            .map(|e| e.path())
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with(&format!("{soname}.")))
            })
            .collect();
        // The newest version: .12.10 after .12.9, compared as numbers.
        let version = |p: &PathBuf| -> Vec<u64> {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name[soname.len()..]
                .split('.')
                .filter_map(|x| x.parse().ok())
                .collect()
        };
        versioned.sort_by_key(version);
        versioned.pop()
    })
}

/// For the error naming a missing CUDA 12 library `lib<lib>.so.12`: where
/// CUDA 13's copy lies in `dirs`, if anywhere, and how to use it. distgpt
/// binds CUDA 12's API, and CUDA 13's NVRTC and cuBLAS serve every call it
/// makes (`scripts/gpu_check.sh` ran them so on an H100), but cudarc opens
/// them only by a name it knows: `lib<lib>.so` is the first it tries.
pub(super) fn cuda13_hint(dirs: &[PathBuf], lib: &str) -> String {
    match find(dirs, &format!("lib{lib}.so.13")) {
        Some(path) => format!(
            "; CUDA 13's {} is there and serves too: put a link to it named lib{lib}.so \
             in a folder on LD_LIBRARY_PATH",
            path.display()
        ),
        None => String::new(),
    }
}

/// Opens, once per process, each wanted library the loader cannot find by
/// name but one of the search folders holds. Returns the ones it opened.
pub(super) fn preload() -> &'static [PathBuf] {
    static DONE: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DONE.get_or_init(|| {
        let dirs = search_dirs();
        let mut opened = Vec::new();
        for soname in WANTED {
            // SAFETY: CUDA's libraries run no initialisers with preconditions.
            if soname != WANTED[0] && unsafe { Library::new(soname) }.is_ok() {
                continue; // on the loader's path already
            }
            let Some(path) = find(&dirs, soname) else {
                continue;
            };
            // SAFETY: as above. Kept loaded for the life of the process, so
            // cudarc's later open by name finds this copy.
            if let Ok(lib) = unsafe { Library::new(&path) } {
                std::mem::forget(lib);
                opened.push(path);
            }
        }
        opened
    })
}

/// The CUDA libraries this process has loaded, by the files the loader
/// mapped (`/proc/self/maps`): what a search, a link or `LD_LIBRARY_PATH`
/// resolved to, CUDA 13's copies where they stand in. Empty where /proc is
/// not there.
pub(super) fn loaded() -> Vec<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    loaded_in(&maps)
}

/// The CUDA libraries' files among a `/proc/PID/maps` listing, once each.
fn loaded_in(maps: &str) -> Vec<PathBuf> {
    const NAMES: [&str; 5] = [
        "libcuda.",
        "libnvrtc.",
        "libnvrtc-builtins.",
        "libcublas",
        "libnccl.",
    ];
    let mut out: Vec<PathBuf> = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(PathBuf::from)
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            NAMES.iter().any(|n| name.starts_with(n))
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wheel_layout_is_searched_and_versioned_names_match() {
        let scratch = crate::testdir::TestDir::new("cudalibs");
        let root = scratch.path();
        let lib = root.join("lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnvrtc-builtins.so.12.8"), b"").unwrap();
        std::fs::write(lib.join("libnvrtc-builtins.so.12.10"), b"").unwrap();
        std::fs::write(lib.join("libnvrtc.so.12"), b"").unwrap();
        let dirs = vec![PathBuf::from("/nonexistent"), lib.clone()];
        assert_eq!(
            find(&dirs, "libnvrtc.so.12"),
            Some(lib.join("libnvrtc.so.12"))
        );
        assert_eq!(
            find(&dirs, "libnvrtc-builtins.so.12"),
            Some(lib.join("libnvrtc-builtins.so.12.10"))
        );
        assert_eq!(find(&dirs, "libcublas.so.12"), None);
        // CUDA 13's wheels (nvidia/cu13/lib) hold .so.13 only: named in the hint.
        let cu13 = root.join("lib/python3.12/site-packages/nvidia/cu13/lib");
        std::fs::create_dir_all(&cu13).unwrap();
        std::fs::write(cu13.join("libcublas.so.13"), b"").unwrap();
        let dirs = [cu13.clone()];
        let hint = cuda13_hint(&dirs, "cublas");
        assert!(
            hint.contains(&cu13.join("libcublas.so.13").display().to_string())
                && hint.contains("named libcublas.so"),
            "{hint}"
        );
        assert_eq!(cuda13_hint(&dirs, "nvrtc"), "");
        assert_eq!(
            site_packages(root),
            [root.join("lib/python3.12/site-packages")]
        );
    }

    #[test]
    fn the_loaded_libraries_are_read_off_the_maps_once_each() {
        let maps = "\
7f00-7f10 r--p 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f10-7f20 r-xp 00010000 08:01 1 /usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04
7f20-7f30 r--p 00000000 08:01 2 /usr/local/cuda/lib64/libnvrtc.so.13.0.88
7f30-7f40 r--p 00000000 08:01 3 /venv/nvidia/cu13/lib/libcublasLt.so.13
7f40-7f50 r--p 00000000 08:01 4 /venv/nvidia/nccl/lib/libnccl.so.2
7f50-7f60 r--p 00000000 08:01 5 /usr/lib/x86_64-linux-gnu/libc.so.6
7f60-7f70 rw-p 00000000 00:00 0
7f70-7f80 rw-p 00000000 00:00 0 [heap]
";
        let got: Vec<String> = loaded_in(maps)
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        assert_eq!(
            got,
            [
                "/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04",
                "/usr/local/cuda/lib64/libnvrtc.so.13.0.88",
                "/venv/nvidia/cu13/lib/libcublasLt.so.13",
                "/venv/nvidia/nccl/lib/libnccl.so.2",
            ]
        );
    }
}
