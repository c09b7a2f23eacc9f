"""The Kubernetes Pod Security Standards (`baseline`, `restricted`) as a checker of one pod spec.

Written from the standard's published controls (kubernetes.io/docs/concepts/security/pod-security-
standards, the policy of Kubernetes 1.30+, the one pod-security admission enforces as `latest`); each
violation names its control as the admission controller does. Windows-only and node-level controls
(hostProcess, AppArmor annotations) are checked where a pod spec carries them.
"""

from __future__ import annotations

from typing import Any

BASELINE_CAPS = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected",
    "secret",
}  # fmt: skip
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}  # fmt: skip
SELINUX_TYPES = {None, "", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod.get("containers", []), *pod.get("ephemeralContainers", [])]


def baseline(pod: dict) -> list[str]:
    out = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"host namespaces: {key}=true")
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            out.append(f"hostPath volumes: {v['name']}")
    if (psc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("seccompProfile: pod Unconfined")
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("hostProcess: pod")
    for s in psc.get("sysctls", []):
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"forbidden sysctls: {s['name']}")
    if _selinux_bad(psc.get("seLinuxOptions")):
        out.append("seLinuxOptions: pod")
    for c in _containers(pod):
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("privileged"):
            out.append(f"privileged: {name}")
        added = set((sc.get("capabilities") or {}).get("add", [])) - BASELINE_CAPS
        if added:
            out.append(f"non-default capabilities: {name} adds {sorted(added)}")
        for port in c.get("ports", []):
            if port.get("hostPort"):
                out.append(f"hostPort: {name} {port['hostPort']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"seccompProfile: {name} Unconfined")
        if sc.get("procMount", "Default") != "Default":
            out.append(f"procMount: {name}")
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"hostProcess: {name}")
        if _selinux_bad(sc.get("seLinuxOptions")):
            out.append(f"seLinuxOptions: {name}")
        if (sc.get("appArmorProfile") or {}).get("type") == "Unconfined":
            out.append(f"appArmorProfile: {name} Unconfined")
    return out


def restricted(pod: dict) -> list[str]:
    out = baseline(pod)
    psc = pod.get("securityContext") or {}
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"restricted volume types: {v['name']} is {sorted(kinds)}")
    pod_nonroot = psc.get("runAsNonRoot") is True
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")
    if psc.get("runAsUser") == 0:
        out.append("runAsUser=0: pod")
    for c in _containers(pod):
        sc, name = c.get("securityContext") or {}, c["name"]
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"allowPrivilegeEscalation != false: {name}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            out.append(f"unrestricted capabilities: {name} does not drop ALL")
        extra = set(caps.get("add", [])) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"unrestricted capabilities: {name} adds {sorted(extra)}")
        if not (sc.get("runAsNonRoot") is True or (pod_nonroot and sc.get("runAsNonRoot") is not False)):
            out.append(f"runAsNonRoot != true: {name}")
        if sc.get("runAsUser") == 0:
            out.append(f"runAsUser=0: {name}")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if not (seccomp in ("RuntimeDefault", "Localhost") or (pod_seccomp and seccomp is None)):
            out.append(f"seccompProfile: {name} neither RuntimeDefault nor Localhost")
    return out


def _selinux_bad(opts: Any) -> bool:
    if not opts:
        return False
    return opts.get("type") not in SELINUX_TYPES or bool(opts.get("user")) or bool(opts.get("role"))


def pods(rayservice: dict) -> dict[str, dict]:
    """Every pod template of a RayService: group name -> pod spec (the head as `head`)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for g in cluster.get("workerGroupSpecs", []):
        out[g["groupName"]] = g["template"]["spec"]
    return out


__all__ = ["baseline", "pods", "restricted"]
