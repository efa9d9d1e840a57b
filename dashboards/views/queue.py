"""The Queue page: profiles queued as Ray Jobs (profiler.service.jobs)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import transforms as T
from dashboards import widgets as W


def jobs_address() -> str:
    """The Ray job server's address."""
    from profiler.service.jobs import address

    return address()  # attnprof serve sets $ATTNPROF_JOBS_ADDRESS


def sidebar(root: Path) -> tuple[dict, dict]:
    """Where the jobs run and land, and the sweep to queue, on the page itself; nothing for the URL."""
    st.caption(f"Profiles queued as Ray Jobs at {jobs_address()}; their runs land in `{root.resolve()}` "
               "unless the sweep names another folder (out:).")
    return {}, {"text": queue_ui(), "results": root.resolve()}


def queue_ui() -> str:
    """The sweep to queue, as YAML: composed from widgets, or pasted."""
    from profiler.attention import backends
    from profiler.unet.models import known_models

    mode = W.choice_ui("Sweep", ["Compose", "Paste YAML"], "queue_mode", "Compose", horizontal=True)
    if mode == "Paste YAML":
        return st.text_area("Sweep config (the keys of configs/sweeps/*.yaml)", T.sweep_yaml(["tiny-sd15"],
                            "256x256, 512x512", "1", ["float32"], ["naive", "sdpa"], "cpu"), height=260,
                            key="queue_yaml")
    a, b, c = st.columns(3)
    models = a.multiselect("Models", list(known_models()), default=["sd15"], key="q_models")
    sizes = b.text_input("Sizes (WxH, comma-separated)", "512x512, 768x768", key="q_sizes")
    batch = c.text_input("Batch sizes (comma-separated)", "1", key="q_batch")
    dtypes = a.multiselect("Dtypes (none: the device's own, float16 on CUDA, float32 on the CPU)",
                           ["float16", "bfloat16", "float32"], default=[], key="q_dtypes")
    chosen = b.multiselect("Backends", backends.names(), default=["naive", "sdpa"], key="q_backends")
    device = c.selectbox("Device", ["auto", "cuda", "cpu"], key="q_device")
    text = T.sweep_yaml(models, sizes, batch, dtypes, chosen, device)
    st.code(text, language="yaml")
    return text


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def unlocked() -> bool:
    """Whether this browser session may queue, stop and read logs: on the loopback address the page acts for its
    user; beyond it, whoever reaches the page must first show Ray's token (token_ui), once per session."""
    return str(st.get_option("server.address") or "") in LOOPBACK or bool(st.session_state.get("token_ok"))


def token_ui() -> None:
    """Asks for Ray's token where the page is reachable beyond this machine, and checks it (not stored elsewhere)."""
    import hmac

    from profiler.service.jobs import token

    if unlocked():
        return
    entered = st.text_input("Ray's token (this page is reachable beyond this machine: `ray get-auth-token` on the "
                            "head prints it)", type="password", key="token_entered")
    expected = token()
    if entered and expected and hmac.compare_digest(entered.strip().encode(), expected.encode()):
        st.session_state["token_ok"] = True
        st.success("token accepted for this browser session")
    elif entered:
        st.error("that is not the cluster's token" if expected else
                 "no token to check it against here: start the service with attnprof serve (token auth on)")


def draw(text: str, results: Path) -> None:
    """The token where one is needed, the submit button, the jobs."""
    from profiler.service import jobs
    from profiler.spec import InputError

    token_ui()
    if st.button("Validate and submit", type="primary"):
        if not unlocked():
            st.error("nothing queued: enter Ray's token above first")
        else:
            try:
                sid, folder = jobs.submit(text, "the Queue page", addr=jobs_address(), fallback=results)
            except InputError as e:  # a bad config (nothing queued), or no job server
                st.error(str(e))
            else:
                st.success(f"queued {sid}: it runs on the cluster; its run lands in `{folder}`"
                           + (" and appears on the Runs page" if folder == results else ""))
                st.session_state["queue_job"] = sid  # the jobs table below follows it
    st.subheader("Jobs")
    jobs_table()


@st.fragment(run_every=2)
def jobs_table() -> None:
    """The jobs at the job server, redrawn every 2 s; the chosen one's status, its stop button and its log."""
    from profiler.service import jobs
    from profiler.spec import InputError

    address = jobs_address()
    try:
        rows = jobs.jobs(address)
    except InputError as e:
        st.warning(f"{e}. Compose and validate anyway; nothing can be queued until a job server answers.")
        return
    if not rows:
        W.empty(f"No profiles queued at {address} yet.")
        return
    shown = pd.DataFrame(rows).assign(cells=lambda d: [f"{a}/{b}" if b == b and b is not None else "-"
                                                       for a, b in zip(d["cells_done"], d["cells_total"])])
    st.table(shown[["job", "status", "cells", "folder", "submitted", "ended", "source", "message"]])
    job = st.selectbox("Job", [r["job"] for r in rows], key="queue_job")
    status = next(r["status"] for r in rows if r["job"] == job)
    st.markdown(f"**{job}**: {status}")
    if not unlocked():
        st.caption("Enter Ray's token above to stop a job or read its log.")
        return
    try:
        if status in ("PENDING", "RUNNING") and st.button("Stop this job", key="queue_stop"):
            jobs.stop(job, address)
            st.info(f"stopping {job}: its finished cells stay stored and the run can be resumed")
        with st.expander("Log"):
            st.code(jobs.logs(job, address)[-6000:] or "(empty)")
    except InputError as e:
        st.warning(str(e))
