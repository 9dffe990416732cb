"""scripts/ncu_kernel_table.py on a made-up ncu --csv run: units scaled, medians, launch order."""

import importlib.util
from pathlib import Path

SPEC = importlib.util.spec_from_file_location("ncu_kernel_table",
                                              Path(__file__).parent.parent / "scripts" / "ncu_kernel_table.py")
ncu_kernel_table = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ncu_kernel_table)

HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"\n')


def line(i, kernel, metric, unit, value):
    return (f'"{i}","1","python3","h","{kernel}(const int *, int)","1","7","(256, 1, 1)","(8, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"\n')


def test_medians_in_launch_order_with_units_scaled():
    text = "==PROF== Connected to process 1\n" + HEAD
    for i, (ns, kb) in enumerate([(12000, "900"), (11000, "1,100"), (13000, "1,000")]):
        text += line(2 * i, "void lora_down_delta<1>", "gpu__time_duration.sum", "nsecond", ns)
        text += line(2 * i, "void lora_down_delta<1>", "dram__bytes_read.sum", "Kbyte", kb)
        text += line(2 * i + 1, "decode_reduce", "gpu__time_duration.sum", "usecond", "2.5")
    out = ncu_kernel_table.table(text).splitlines()
    assert [o.split()[0] for o in out] == ["void", "decode_reduce"]
    assert out[0].split()[2:4] == ["12.00", "1.00"]  # us, MB
    assert out[1].split()[1:3] == ["2.50", "-"]


def test_no_csv_says_so():
    assert "no kernels" in ncu_kernel_table.table("==ERROR== failed\n")


def test_the_random_draws_kernels_are_left_out():
    text = HEAD
    for i, k in enumerate(["void init_curand<curand_pseudo_state<curandState>>", "cupy_multiply__float32_float_float32",
                           "void cub::DeviceReduceKernel<cub::policy_hub<unsigned>>",
                           "void execute_dist<standard_normal_float_functor>", "void grouped_gemm<2, 64, 64, 4, 0>"]):
        text += line(i, k, "gpu__time_duration.sum", "usecond", "3.0")
    assert [o.split()[:2] for o in ncu_kernel_table.table(text).splitlines()] == [["void", "grouped_gemm<2,"]]
