//! The seccomp filter an HDF5 helper installs before it reads a request.
//!
//! A deny list, not an allow list: libhdf5, its filter plugins and the C
//! library may use many system calls to read a file, and a call missing from
//! an allow list would fail every open in production. What a helper must never
//! do is denied (`EPERM`): start programs or processes, open sockets or talk
//! to other processes, change credentials, namespaces, mounts or the kernel,
//! create, write, rename, link, remove or re-permission files (an open for
//! writing or creating included), trace or read other processes, or use
//! io_uring, BPF or user-space fault handling. Code that a crafted file gets
//! to run in the helper can then read what the user may read (it runs as the
//! user) and answer the daemon with lies (checked there), and nothing else.

use std::collections::BTreeMap;

use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// System calls denied outright.
const DENIED: &[i64] = &[
    // Programs and processes (threads use clone with CLONE_THREAD: allowed).
    libc::SYS_execve,
    libc::SYS_execveat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_fork,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_vfork,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_kill,
    libc::SYS_pidfd_open,
    libc::SYS_pidfd_getfd,
    libc::SYS_pidfd_send_signal,
    // New connections (the socket to the daemon is already open).
    libc::SYS_socket,
    libc::SYS_socketpair,
    libc::SYS_connect,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept,
    libc::SYS_accept4,
    // Credentials, namespaces, mounts, the kernel.
    libc::SYS_setuid,
    libc::SYS_setgid,
    libc::SYS_setreuid,
    libc::SYS_setregid,
    libc::SYS_setresuid,
    libc::SYS_setresgid,
    libc::SYS_setgroups,
    libc::SYS_setfsuid,
    libc::SYS_setfsgid,
    libc::SYS_capset,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_kexec_load,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_open_by_handle_at,
    libc::SYS_name_to_handle_at,
    // Changing files.
    libc::SYS_mknodat,
    libc::SYS_symlinkat,
    libc::SYS_linkat,
    libc::SYS_unlinkat,
    libc::SYS_renameat,
    libc::SYS_renameat2,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_fchown,
    libc::SYS_fchownat,
    libc::SYS_truncate,
    libc::SYS_ftruncate,
    libc::SYS_mkdirat,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_mknod,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_symlink,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_link,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_unlink,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_rename,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chmod,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chown,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_lchown,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_mkdir,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_rmdir,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_creat,
];

/// Why the filter could not be installed.
#[derive(Debug, thiserror::Error)]
pub(super) enum SandboxError {
    /// seccompiler does not build filters for this machine.
    #[error("no seccomp filter for {0} machines")]
    Arch(&'static str),
    /// A rule or the filter could not be built, or the kernel refused it.
    #[error("{0}")]
    Seccomp(#[from] seccompiler::Error),
    /// The filter could not be compiled to BPF.
    #[error("{0}")]
    Backend(#[from] seccompiler::BackendError),
}

/// The helper's filter, compiled for this machine.
fn filter() -> Result<seccompiler::BpfProgram, SandboxError> {
    let arch: TargetArch = std::env::consts::ARCH.try_into().map_err(|_| SandboxError::Arch(std::env::consts::ARCH))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&call| (call, Vec::new())).collect();
    // Opens that could write or create: any access mode but read-only, or
    // O_CREAT / O_TRUNC.
    let flag_rules = |arg: u8| -> Result<Vec<SeccompRule>, SandboxError> {
        let cond = |mask: u64, value: u64| {
            SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::MaskedEq(mask), value)
        };
        let rule = |c| SeccompRule::new(vec![c]);
        let mode = libc::O_ACCMODE as u64;
        Ok(vec![
            rule(cond(mode, libc::O_WRONLY as u64)?)?,
            rule(cond(mode, libc::O_RDWR as u64)?)?,
            rule(cond(libc::O_CREAT as u64, libc::O_CREAT as u64)?)?,
            rule(cond(libc::O_TRUNC as u64, libc::O_TRUNC as u64)?)?,
        ])
    };
    rules.insert(libc::SYS_openat, flag_rules(2)?);
    #[cfg(target_arch = "x86_64")]
    rules.insert(libc::SYS_open, flag_rules(1)?);
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), arch)?;
    Ok(filter.try_into()?)
}

/// Installs the filter on this process (the helper has one thread, and has
/// `no_new_privs` from its start).
pub(super) fn install() -> Result<(), SandboxError> {
    let program = filter()?;
    Ok(seccompiler::apply_filter(&program)?)
}
