"""Kernel classes: the code that computes a board's bits is part of its model's identity.

The pure part (llama.cpp's system info -> class name, class -> fingerprint) in milliseconds; then the
real thing: the project's AVX2 build and a second build of the same llama.cpp with other kernels
(``dashboard.bench.llama_kernels``: AVX-512 where the CPU has it, else SSE4.2, so on any x86-64
machine) answering one prompt through ``manage.py infer`` against one cache box.
"""

import json

import pytest

from cachebox.keys import STATE_FORMAT_VERSION, ModelIdentity, parse_entry_key_name, prefix_keys
from cachebox.store import CacheBox
from inference.contract.messages import BoardStatus
from inference.engine.kernels import CLASS_RE, KernelClass, class_name, name_of, parse_system_info
from tests.conftest import run_manage

# What llama.cpp 0.3.36 prints (llama_print_system_info) for the project's build, the AVX-512 and
# SSE4.2 builds of the same sources, and (from ggml's feature list) a Pi Zero 2W's and a Pi 5's native builds.
AVX2 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
AVX512 = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | AVX512 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
SSE42 = "CPU : SSE3 = 1 | SSSE3 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "  # ggml reports no SSE4 of its own
A53 = "CPU : NEON = 1 | ARM_FMA = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
A76 = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
BUILD = "llama-cpp-python 0.3.36 ggml 0.25.3 (0c1e570-dirty)"


def identity(kernels: str) -> ModelIdentity:
    return ModelIdentity(gguf_sha256="ab" * 32, kv_type="f16", llama_build="llama-cpp-python 0.3.36", kernels=kernels)


def test_system_info_parses_into_backends_and_their_features():
    assert parse_system_info(AVX2) == {
        "CPU": {
            f: "1" for f in ("SSE3", "SSSE3", "AVX", "AVX2", "F16C", "FMA", "BMI2", "LLAMAFILE", "OPENMP", "REPACK")
        }
    }
    two = parse_system_info("CPU : NEON = 1 | SVE = 0 | SVE_CNT = 16 | BLAS : ACCELERATE = 1 | ")
    assert two == {"CPU": {"NEON": "1", "SVE_CNT": "16"}, "BLAS": {"ACCELERATE": "1"}}  # "0": not there
    assert parse_system_info("") == {} and parse_system_info("garbage without pairs") == {}


@pytest.mark.parametrize(
    "machine, info, name",
    [
        ("x86_64", AVX2, "x86_64-avx2"),
        ("x86_64", AVX512, "x86_64-avx512"),
        (
            "AMD64",
            AVX512.replace("AVX512 = 1", "AVX512 = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1"),
            "x86_64-avx512-vnni-bf16",
        ),
        ("x86_64", SSE42, "x86_64-ssse3"),
        ("x86_64", "CPU : OPENMP = 1 | ", "x86_64-generic"),
        ("aarch64", A53, "aarch64-armv8.0"),
        ("aarch64", A76, "aarch64-armv8.2-dotprod-fp16"),
        (
            "arm64",
            A76.replace("DOTPROD = 1", "DOTPROD = 1 | MATMUL_INT8 = 1 | SVE = 1"),
            "aarch64-armv8.6-dotprod-fp16-i8mm-sve",
        ),
        ("riscv64", "CPU : RISCV_V = 1 | RVV_VLEN = 32 | OPENMP = 1 | ", "riscv64-generic-riscv_v-rvv_vlen"),
    ],
)
def test_the_class_name_says_the_machine_and_the_kernels_it_was_compiled_for(machine, info, name):
    kernels = KernelClass.from_report(machine, info, BUILD)
    assert kernels.name == name and CLASS_RE.match(name)
    assert class_name(machine, parse_system_info(info)["CPU"]) == name
    assert name_of(kernels.identity) == name and kernels.identity.endswith(":" + kernels.digest())


def test_the_digest_covers_every_feature_and_the_build_and_is_stable():
    avx2 = KernelClass.from_report("x86_64", AVX2, BUILD)
    assert avx2.digest() == KernelClass.from_report("x86_64", AVX2, "  " + BUILD).digest() and len(avx2.digest()) == 16
    others = [
        KernelClass.from_report("x86_64", AVX512, BUILD),
        KernelClass.from_report(
            "x86_64", AVX2.replace("LLAMAFILE = 1 | ", ""), BUILD
        ),  # same name, another kernel path
        KernelClass.from_report("x86_64", AVX2, BUILD.replace("0.3.36", "0.3.37")),  # another llama.cpp
        KernelClass.from_report("i686", AVX2, BUILD),
    ]
    assert others[1].name == avx2.name == "x86_64-avx2"
    assert len({avx2.digest(), *(other.digest() for other in others)}) == 5


def test_boards_of_different_kernel_classes_have_different_fingerprints_and_keys():
    avx2, avx512 = (KernelClass.from_report("x86_64", info, BUILD) for info in (AVX2, AVX512))
    a53, a76 = (KernelClass.from_report("aarch64", info, BUILD) for info in (A53, A76))
    fingerprints = {identity(k.identity).fingerprint() for k in (avx2, avx512, a53, a76)}
    assert len(fingerprints) == 4
    assert (
        identity(avx2.identity).fingerprint()
        == identity(KernelClass.from_report("x86_64", AVX2, BUILD).identity).fingerprint()
    )
    tokens = list(range(1, 300))
    keys = {fp: prefix_keys("ns", fp, tokens, [128, 256, 299], grid=128) for fp in fingerprints}
    assert len({key for found in keys.values() for key in found}) == 12  # no key in common: a miss, never an exact hit


def test_the_state_format_was_bumped_so_entries_stored_before_kernel_classes_stop_matching():
    # Entries stored by version 4 came from a board of any class: no fingerprint of today reaches them
    # (6: entries are also signed by their producer).
    assert STATE_FORMAT_VERSION == 6
    old = ModelIdentity("ab" * 32, "f16", "llama-cpp-python 0.3.36", state_format=4)
    now = identity(KernelClass.from_report("x86_64", AVX2, BUILD).identity)
    assert (
        old.fingerprint()
        != now.fingerprint()
        != ModelIdentity("ab" * 32, "f16", "llama-cpp-python 0.3.36").fingerprint()
    )


def test_a_heartbeat_carries_a_small_validated_kernel_class():
    assert BoardStatus(kernel_class="aarch64-armv8.2-dotprod-fp16").kernel_class == "aarch64-armv8.2-dotprod-fp16"
    for bad in ("X86_64 AVX2", "a" * 65, "x86;drop", "-avx"):
        with pytest.raises(ValueError):
            BoardStatus(kernel_class=bad)


@pytest.mark.model
def test_the_loaded_llama_cpp_names_its_kernel_class_in_the_engines_identity(engine):
    from inference.engine.bindings import kernel_class

    kernels = kernel_class()
    assert engine.kernels == kernels and engine.identity.kernels == kernels.identity
    assert kernels.machine == "x86_64" and kernels.name.startswith("x86_64-")
    assert ("CPU", "AVX2", "1") in kernels.features  # the project's build (-DGGML_NATIVE=OFF: AVX2, no AVX-512)
    assert "ggml 0." in kernels.build and "llama-cpp-python" in kernels.build
    assert engine.fingerprint == engine.identity.fingerprint()


# -- two builds of the same llama.cpp, one cache box ------------------------------------------------

PROMPT = (
    " ".join(
        f"Note {index}: the lighthouse keeper logged the tide, the wind from the {side} and {index * 3} ships passing the cape."
        for index, side in enumerate(["north", "east", "south", "west"] * 3)
    )
    + " Summarize the log in one sentence:"
)


def _infer(prompt_file, store_url: str, namespace: str, libs=None, *options: str):
    env = {"REDIS_URL": store_url, "EDGECACHE_N_CTX": "2048"}
    if libs is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(libs)
    done = run_manage(
        "infer",
        "--prompt-file",
        str(prompt_file),
        "--namespace",
        namespace,
        "--max-tokens",
        "4",
        "--json",
        *options,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout)


@pytest.mark.processes
@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.kernels
@pytest.mark.timeout(1800)  # the first run on a machine waits for the other build (minutes on 2 cores)
def test_a_board_of_another_kernel_class_never_takes_a_state_as_exact(
    tmp_path, valkey_url, namespace, other_kernel_libs
):
    from dashboard.bench.llama_kernels import VARIANTS

    variant, libs = other_kernel_libs
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    store = CacheBox(valkey_url)

    stored = _infer(prompt, valkey_url, namespace)  # the project's build (AVX2) computes and stores it
    assert stored["case"] == "miss" and stored["kernel_class"] == "x86_64-avx2" and stored["prompt_tokens"] > 256
    avx2_models = {parse_entry_key_name(name)[1] for name in store.scan_entries(namespace)}
    assert len(avx2_models) == 1

    other = _infer(prompt, valkey_url, namespace, libs=libs)  # the same llama.cpp, the variant's kernels
    assert other["kernel_class"] == VARIANTS[variant].kernel_class != "x86_64-avx2"
    assert other["fingerprint"] != stored["fingerprint"]
    assert other["case"] == "miss" and other["matched_tokens"] == 0 and other["fetched_tokens"] == 0, other
    models = {parse_entry_key_name(name)[1] for name in store.scan_entries(namespace)}
    assert len(models) == 2 and avx2_models < models  # it stored its own, under a fingerprint of its own

    again = _infer(prompt, valkey_url, namespace)  # the AVX2 build still hits its own entry, exactly
    assert again["kernel_class"] == "x86_64-avx2"
    assert again["case"] == "full" and again["matched_tokens"] == again["prompt_tokens"] == stored["prompt_tokens"]
    assert again["text"] == stored["text"]
    back = _infer(prompt, valkey_url, namespace, libs=libs)  # and the other build its own
    assert back["case"] == "full" and back["text"] == other["text"]


# -- what the control plane shows of a board's class -------------------------------------------------
from dashboard import actions  # noqa: E402
from tests.dashboard.test_dashboard import control_plane, enrolled, heartbeat, register, sent_tasks, staff_client  # noqa: E402,F401  (fixtures)


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_device_page_and_metrics_show_each_boards_kernel_class(control_plane, staff_client, settings):
    from django.urls import reverse
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dashboard.models import Device
    from dashboard.ops import metrics

    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    settings.EDGECACHE_BOARD_ACL = False
    zero, token = register("zero")
    actions.record_heartbeat(
        heartbeat(enrolled(zero, token), {"fingerprint": "0123456789abcdef", "kernel_class": "aarch64-armv8.0"})
    )
    pi5, token = register("pi5")
    actions.record_heartbeat(
        heartbeat(enrolled(pi5, token), {"kernel_class": "aarch64-armv8.2-dotprod-fp16"}, device="pi5")
    )
    register("ghost")  # never beat
    assert Device.objects.get(name="zero").kernel_class == "aarch64-armv8.0"

    page = staff_client.get(reverse("device-detail", args=["zero"])).content.decode()
    assert '<code data-role="kernel-class">aarch64-armv8.0</code>' in page and "0123456789abcdef" in page
    assert "not reported yet" in staff_client.get(reverse("device-detail", args=["ghost"])).content.decode()

    found = {}
    for family in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode()):
        for sample in family.samples:
            if sample.name == "edgecache_board_kernel_class_info":
                found[sample.labels["device"]] = (sample.labels["kernel_class"], sample.value)
    assert found == {"zero": ("aarch64-armv8.0", 1.0), "pi5": ("aarch64-armv8.2-dotprod-fp16", 1.0), "ghost": ("", 1.0)}


# -- approximate sharing across kernel classes: a namespace's choice, off by default ----------------
AVX2_FP, AVX512_FP, OTHER_KV_FP = "1111111111111111", "2222222222222222", "3333333333333333"


def _board(name, fingerprint, kernel_class, kv_type="f16"):
    device, token = register(name)
    keys = enrolled(device, token)
    status = {
        "model": "gemma-3-270m-q4_k_m.gguf",
        "fingerprint": fingerprint,
        "kernel_class": kernel_class,
        "kv_type": kv_type,
    }
    assert actions.record_heartbeat(heartbeat(keys, status, device=name)) is not None
    device.refresh_from_db()
    return device, keys


@pytest.mark.django_db
@pytest.mark.cachebox
def test_runs_learn_the_other_classes_only_where_the_namespace_shares_across_them(control_plane, sent_tasks):
    from dashboard.models import Namespace

    avx2, _ = _board("avx2", AVX2_FP, "x86_64-avx2")
    _board("avx2-twin", AVX2_FP, "x86_64-avx2")  # its own class: exact already
    _board("avx512", AVX512_FP, "x86_64-avx512")
    _board("q8", OTHER_KV_FP, "x86_64-avx512", kv_type="q8_0")  # another KV type: its states cannot be loaded at all
    assert Namespace.objects.get(name="default").share_across_kernel_classes is False  # off by default

    actions.dispatch_run(None, [avx2], actions.run_request(segments=["Exact only?"], max_tokens=2))
    assert sent_tasks[-1]["args"][0]["approximate_from"] == {}
    Namespace.objects.filter(name="default").update(share_across_kernel_classes=True)
    avx2.refresh_from_db()
    actions.dispatch_run(None, [avx2], actions.run_request(segments=["And now?"], max_tokens=2))
    assert sent_tasks[-1]["args"][0]["approximate_from"] == {AVX512_FP: "x86_64-avx512"}
    actions.dispatch_run(None, [avx2], actions.run_request(segments=["A lab run?"], max_tokens=2, strategy="anchors"))
    assert sent_tasks[-1]["args"][0]["approximate_from"] == {}  # lab strategies never read the cache box


@pytest.mark.django_db
@pytest.mark.cachebox
def test_a_run_that_used_another_classes_state_says_so_on_its_page_export_and_metrics(
    control_plane, staff_client, settings
):
    from django.urls import reverse
    from prometheus_client.exposition import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from dashboard.ops import metrics
    from tests.dashboard.test_dashboard import result_payload

    settings.EDGECACHE_METRICS_CACHE_SECONDS = 0
    device, keys = _board("avx2", AVX2_FP, "x86_64-avx2")
    approximate = {
        "case": "full",
        "ttft_ms": 20.0,
        "prompt_tokens": 300,
        "matched_tokens": 300,
        "fetched_tokens": 300,
        "tier": "cachebox",
        "kernel_class": "x86_64-avx2",
        "approximate": "cross-class",
        "approximate_from": "x86_64-avx512",
    }
    run = actions.record_run(result_payload(device, keys, breakdown=approximate, uploaded=[]))
    exact = actions.record_run(result_payload(device, keys, uploaded=[]))
    assert run is not None and exact is not None
    assert run.served_from == "300/300 prompt tokens from the cache box (approximate: cross-class from x86_64-avx512)"
    assert (
        run.source_label == "cache box (approximate)"
        and exact.approximate_label == ""
        and "approximate" not in exact.served_from
    )

    page = staff_client.get(reverse("run-detail", args=[run.pk])).content.decode()
    assert 'id="run-approximate"' in page and "approximate: cross-class from x86_64-avx512" in page
    assert 'id="run-approximate"' not in staff_client.get(reverse("run-detail", args=[exact.pk])).content.decode()
    by_id = {row["id"]: row for row in staff_client.get(reverse("runs-export-json")).json()["runs"]}
    assert (by_id[run.pk]["approximate"], by_id[run.pk]["approximate_from"], by_id[run.pk]["kernel_class"]) == (
        "cross-class",
        "x86_64-avx512",
        "x86_64-avx2",
    )
    assert by_id[exact.pk]["approximate"] == ""
    csv_text = b"".join(staff_client.get(reverse("runs-export-csv")).streaming_content).decode()
    assert "approximate,approximate_from" in csv_text.splitlines()[0] and ",cross-class,x86_64-avx512," in csv_text

    samples = [
        s
        for family in text_string_to_metric_families(generate_latest(metrics.REGISTRY).decode())
        for s in family.samples
        if s.name == "edgecache_approximate_runs_total"
    ]
    from dashboard.api.views import EXTENSION_FIELDS

    assert {"kernel_class", "approximate", "approximate_from"} <= set(EXTENSION_FIELDS)  # the API's "edgecache" object
    assert [(s.labels, s.value) for s in samples] == [
        ({"device": "avx2", "namespace": "default", "approximate": "cross-class", "source_class": "x86_64-avx512"}, 1.0)
    ]


@pytest.mark.processes
@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.kernels
@pytest.mark.timeout(1800)
def test_with_cross_class_sharing_a_board_restores_another_classes_state_and_says_it_is_approximate(
    tmp_path, valkey_url, namespace, other_kernel_libs
):
    from dashboard.bench.llama_kernels import VARIANTS

    variant, libs = other_kernel_libs
    kernel_class = VARIANTS[variant].kernel_class
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(PROMPT, encoding="utf-8")
    store = CacheBox(valkey_url)
    stored = _infer(prompt, valkey_url, namespace, libs)  # the other build computes and stores it
    assert stored["case"] == "miss" and stored["kernel_class"] == kernel_class and stored["approximate"] == ""
    other = f"{stored['fingerprint']}={kernel_class}"

    shared = _infer(
        prompt, valkey_url, namespace, None, "--approximate-from", other
    )  # the AVX2 build, sharing across classes
    assert shared["kernel_class"] == "x86_64-avx2" and shared["fingerprint"] != stored["fingerprint"]
    assert shared["case"] == "full" and shared["matched_tokens"] == shared["prompt_tokens"] == stored["prompt_tokens"]
    assert (shared["approximate"], shared["approximate_from"]) == ("cross-class", kernel_class)
    assert shared["uploaded_bytes"] == 0  # nothing computed on another class's state is stored as this class's
    assert {parse_entry_key_name(name)[1] for name in store.scan_entries(namespace)} == {stored["fingerprint"]}

    exact = _infer(prompt, valkey_url, namespace)  # without the option: exact only, a miss
    assert exact["case"] == "miss" and exact["approximate"] == "" and exact["uploaded_bytes"] > 0
    again = _infer(
        prompt, valkey_url, namespace, None, "--approximate-from", other
    )  # its own entry now: exact, not approximate
    assert again["case"] == "full" and again["approximate"] == "" and again["text"] == exact["text"]


# -- bench kernels: the comparisons (pure) ---------------------------------------------------------
def test_bench_kernels_compares_a_served_run_with_the_classes_own_cold_run():
    import numpy as np

    from dashboard.bench.kernels import compare, kl_divergence, lines, summarize

    cold_logits = np.array([2.0, 1.0, 0.0, -1.0], dtype=np.float32)
    assert (
        kl_divergence(cold_logits, cold_logits) == 0.0 and kl_divergence(cold_logits, cold_logits + 5.0) < 1e-12
    )  # a shift changes nothing
    near = cold_logits + np.array([0.0, 0.3, 0.0, 0.0], dtype=np.float32)
    flipped = np.array([1.0, 2.5, 0.0, -1.0], dtype=np.float32)
    cold = {"tokens": [0, 5, 6], "verdict": "A"}
    same = compare(cold, {"tokens": [0, 5, 6], "verdict": "A"}, cold_logits, cold_logits)
    assert same == {
        "first_token": True,
        "greedy": True,
        "verdict": True,
        "max_abs_logit_diff": 0.0,
        "kl": 0.0,
        "bitwise": True,
    }
    close = compare(cold, {"tokens": [0, 5, 7], "verdict": "A"}, cold_logits, near)
    assert (close["first_token"], close["greedy"], close["verdict"], close["bitwise"]) == (True, False, True, False)
    assert close["max_abs_logit_diff"] == pytest.approx(0.3) and close["kl"] > 0
    other = compare(cold, {}, cold_logits, flipped)  # a full hit: logits only
    assert other["first_token"] is False and other["greedy"] is None and other["verdict"] is None
    summary = summarize([same, close, other])
    assert summary["prompts"] == 3 and summary["first_token_agreement"] == pytest.approx(0.6667)
    assert (
        summary["greedy_agreement"] == 0.5
        and summary["mmlu_verdict_agreement"] == 1.0
        and summary["bitwise_logits"] == pytest.approx(0.3333)
    )
    assert summary["max_abs_logit_diff"] == pytest.approx(1.5)
    doc = {
        "prompts": 3,
        "topics": ["astronomy"],
        "shots": 5,
        "grid": 128,
        "classes": [{"name": "x86_64-avx2"}],
        "resume": [{"from": "x86_64-avx512", "to": "x86_64-avx2", **summary}],
        "full_hit": [{"from": "x86_64-avx512", "to": "x86_64-avx2", **summary}],
    }
    printed = "\n".join(lines(doc))
    assert "x86_64-avx512      x86_64-avx2        resume" in printed and "full hit" in printed


# -- the other builds: which one stands for a second class here, and the class it reports (pure) -----
@pytest.mark.parametrize(
    "flags, variant",
    [
        ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 avx512f avx512bw", "avx512"),
        ("fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2", "sse42"),  # an AMD EPYC without AVX-512
        ("fpu sse sse2 ssse3 sse4_1 sse4_2", "sse42"),
        ("fp asimd evtstrm crc32 cpuid", "sse42"),  # an Arm CPU: the last variant, which says what it lacks
    ],
)
def test_the_other_build_is_avx512_where_the_cpu_runs_it_else_sse42(flags, variant):
    from dashboard.bench import llama_kernels

    cpuinfo = f"processor\t: 0\nmodel name\t: some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n"
    assert llama_kernels.default_variant(cpuinfo) == variant
    assert llama_kernels.cpu_runs(variant, cpuinfo) == ("sse4_2" in flags)


def test_each_other_build_names_the_kernel_class_it_reports_and_none_is_the_projects():
    from dashboard.bench.llama_kernels import VARIANTS

    reports = {"avx512": AVX512, "sse42": SSE42}  # what each build printed here (llama_print_system_info)
    assert set(reports) == set(VARIANTS)
    for variant, report in reports.items():
        kernels = KernelClass.from_report("x86_64", report, BUILD)
        assert kernels.name == VARIANTS[variant].kernel_class != "x86_64-avx2"
        assert kernels.digest() != KernelClass.from_report("x86_64", AVX2, BUILD).digest()
    sse42 = VARIANTS["sse42"].flags
    assert "-DGGML_SSE42=ON" in sse42 and {f"-DGGML_{o}=OFF" for o in ("AVX", "AVX2", "FMA", "F16C")} <= set(sse42)
