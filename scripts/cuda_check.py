"""Compile every kernel source as CUDA: NVRTC (through ctypes) to PTX for
compute_90a, then ptxas to sm_90a, printing each kernel's registers,
shared memory, stack frame and spills (`ptxas -v`) as a table, also written
to OUT_DIR/ptxas.tsv. Any NVRTC or ptxas diagnostic, warning included,
fails, and so does any spill (ptxas's --warn-on-spills, and the table's
own count, so that a spill fails even if ptxas stops warning of it).

Usage: cuda_check.py KERNEL_DIR OUT_DIR (run by scripts/cuda-check, which
provides the venv with the NVIDIA wheels).
"""

import ctypes
import functools
import pathlib
import re
import subprocess
import sys

import nvidia.cuda_nvcc
import nvidia.cuda_nvrtc
import nvidia.cuda_runtime

ARCH = "90a"
NVRTC_OPTIONS = [
    f"--gpu-architecture=compute_{ARCH}",
    "--std=c++17",
    "-default-device",
]
PTXAS_OPTIONS = [
    f"-arch=sm_{ARCH}",
    "-v",
    "--warn-on-spills",
    "--warn-on-local-memory-usage",
    "--warn-on-double-precision-use",
    "--warning-as-error",
]


print = functools.partial(print, flush=True)


def package_dir(module):
    return pathlib.Path(list(module.__path__)[0])


class Nvrtc:
    def __init__(self):
        path = package_dir(nvidia.cuda_nvrtc) / "lib" / "libnvrtc.so.12"
        self.lib = ctypes.CDLL(str(path))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)))
        self.version = f"{major.value}.{minor.value}"

    def check(self, status):
        if status != 0:
            raise RuntimeError(self.lib.nvrtcGetErrorString(status).decode())

    def compile(self, source, name, options):
        """Returns (ptx or None, log)."""
        prog = ctypes.c_void_p()
        self.check(
            self.lib.nvrtcCreateProgram(
                ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
            )
        )
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.check(self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)))
            log = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetProgramLog(prog, log))
            log = log.value.decode().strip()
            if status != 0:
                return None, log
            self.check(self.lib.nvrtcGetPTXSize(prog, ctypes.byref(size)))
            ptx = ctypes.create_string_buffer(size.value)
            self.check(self.lib.nvrtcGetPTX(prog, ptx))
            return ptx.value.decode(), log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def ptxas_report(text):
    """Per kernel: registers, shared memory, stack frame, spill stores and
    spill loads (bytes but the registers)."""
    kernels, current = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            kernels[current] = {"regs": 0, "smem": 0, "stack": 0, "spill_st": 0, "spill_ld": 0}
            continue
        if current is None:
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m:
            kernels[current]["regs"] = int(m.group(1))
            m = re.search(r"(\d+) bytes smem", line)
            kernels[current]["smem"] = int(m.group(1)) if m else 0
        m = re.search(r"(\d+) bytes stack frame", line)
        if m:
            kernels[current]["stack"] = int(m.group(1))
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            kernels[current]["spill_st"] = int(m.group(1))
            kernels[current]["spill_ld"] = int(m.group(2))
    return kernels


def main():
    kernel_dir, out_dir = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    out_dir.mkdir(parents=True, exist_ok=True)
    prelude = (kernel_dir / "prelude.h").read_text()
    sources = sorted(kernel_dir.glob("*.cu"))
    if not sources:
        sys.exit(f"cuda-check: no .cu files in {kernel_dir}")
    nvrtc = Nvrtc()
    ptxas = package_dir(nvidia.cuda_nvcc) / "bin" / "ptxas"
    include = package_dir(nvidia.cuda_runtime) / "include"
    options = NVRTC_OPTIONS + [f"--include-path={include}"]
    print(f"NVRTC {nvrtc.version}, {ptxas}, sm_{ARCH}")
    header = f"{'file':<20} {'kernel':<36} {'regs':>5} {'smem B':>7} {'stack B':>7} {'spill B':>7}"
    print(header)
    table = ["file\tkernel\tregisters\tsmem_bytes\tstack_bytes\tspill_store_bytes\tspill_load_bytes"]
    failed = []
    # Each file twice: the portable path OpenCL tests, and the CUDA-only fast
    # paths behind DISTGPT_CUDA_FAST.
    builds = [(src, variant) for src in sources for variant in ("", "fast")]
    for src, variant in builds:
        # The prelude is prepended, as the OpenCL build does.
        # #line keeps diagnostics' line numbers those of the file itself.
        source = f'{prelude}\n#line 1 "{src.name}"\n{src.read_text()}'
        extra = ["-DDISTGPT_CUDA_FAST"] if variant else []
        label = f"{src.name}+{variant}" if variant else src.name
        ptx, log = nvrtc.compile(source, src.name, options + extra)
        if ptx is None or log:
            print(f"{label}: NVRTC {'error' if ptx is None else 'warning'}:\n{log}")
            failed.append(label)
            if ptx is None:
                continue
        stem = f"{src.stem}-{variant}" if variant else src.stem
        ptx_path = out_dir / (stem + ".ptx")
        ptx_path.write_text(ptx)
        cubin = out_dir / (stem + ".cubin")
        run = subprocess.run(
            [str(ptxas), *PTXAS_OPTIONS, str(ptx_path), "-o", str(cubin)],
            capture_output=True,
            text=True,
        )
        text = run.stdout + run.stderr
        problems = [l for l in text.splitlines() if re.search("warning|error", l, re.I)]
        if run.returncode != 0 or problems:
            print(f"{label}: ptxas failed (status {run.returncode}):\n{text}")
            failed.append(label)
        # the table's rows even then: a spill is counted where ptxas told it
        kernels = ptxas_report(text)
        if not kernels and label not in failed:
            print(f"{label}: no kernels found")
            failed.append(label)
        for name, k in kernels.items():
            spill = k["spill_st"] + k["spill_ld"]
            mark = "  SPILLS" if spill else ""
            print(f"{label:<20} {name:<36} {k['regs']:>5} {k['smem']:>7} {k['stack']:>7} {spill:>7}{mark}")
            table.append("\t".join(str(x) for x in (label, name, k["regs"], k["smem"], k["stack"],
                                                    k["spill_st"], k["spill_ld"])))
            if spill:
                failed.append(f"{label} ({name} spills {spill} bytes)")
    (out_dir / "ptxas.tsv").write_text("\n".join(table) + "\n")
    if failed:
        sys.exit(f"cuda-check: FAILED: {', '.join(sorted(set(failed)))}")
    print(f"cuda-check: {len(sources)} files, {len(table) - 1} kernels compiled for sm_{ARCH} without"
          " diagnostics or spills, portable and with the CUDA-only fast paths (-DDISTGPT_CUDA_FAST);"
          f" the table is in {out_dir / 'ptxas.tsv'}")


if __name__ == "__main__":
    main()
