//! The C boundary's promise, tested on the exported symbols themselves: no panic ever
//! leaves one, whatever happens inside it, also when stderr is a closed pipe and when a
//! thread calls in while it exits. A panic that left an `extern "C"` function would abort
//! the process, so each case runs in a child process of its own (this test binary again,
//! running one ignored test), and the parent checks that it ended well.

use std::process::{Command, Output, Stdio};

use crate::abi;
use crate::exports::*;

const MIB: usize = 1 << 20;

/// Set in the child process to the name of the case it runs.
const CASE_VAR: &str = "PINPOOL_TORCH_BOUNDARY_CASE";

/// Runs the ignored test `case` of this module alone in a child process, with `stderr`.
fn run_alone(case: &str, stderr: Stdio) -> Output {
    let name = format!("boundary_tests::{case}");
    Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            &name,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CASE_VAR, case)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .output()
        .expect("the test binary runs again")
}

/// Checks that the child ran `case` and it passed.
fn assert_passed(case: &str, out: &Output) {
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{case}: {:?}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether this process is the child that runs `case`.
fn running(case: &str) -> bool {
    std::env::var(CASE_VAR).is_ok_and(|v| v == case)
}

/// The write end of a pipe whose read end is already closed: every write to it fails
/// (`EPIPE`; the test binary, like Python, ignores `SIGPIPE`).
#[cfg(unix)]
fn closed_pipe() -> Stdio {
    use std::os::fd::{FromRawFd, OwnedFd};
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors `pipe2` writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors were just made and are owned here, once each.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    Stdio::from(write)
}

/// Calls every exported symbol with arguments that fail in any build (a device that does
/// not exist, a pointer never lent, a null path, a null filter), and the ones that take
/// none; checks that each failure is reported as its symbol's failure value.
fn call_every_export() {
    let bad = 0x1234usize as *mut std::ffi::c_void;
    assert!(pinpool_alloc(MIB, 99, std::ptr::null_mut()).is_null());
    pinpool_free(bad, MIB, 99, std::ptr::null_mut());
    pinpool_record_stream(bad, std::ptr::null_mut());
    pinpool_empty_cache();
    pinpool_memory_fraction(2.0, 99);
    let _ = pinpool_init();
    let _ = pinpool_device_count();
    let _ = pinpool_cuda_support();
    // SAFETY: a null buffer only asks for the length.
    let _ = unsafe { pinpool_settings(std::ptr::null_mut(), 0) };
    // SAFETY: a null buffer only asks for the length.
    let stats = unsafe { pinpool_memory_stats(99, std::ptr::null_mut(), 0) };
    assert_eq!(stats, -1);
    assert_eq!(pinpool_reserved_bytes(99), -1);
    assert_eq!(pinpool_reset_peak_stats(99), -1);
    assert_eq!(pinpool_reset_accumulated_stats(99), -1);
    // SAFETY: a null list of actions skips none.
    let _ = unsafe { pinpool_record_history(0, 0, 0, 0, std::ptr::null()) };
    assert_eq!(pinpool_enable_peer_access(99, 0), -1);
    // SAFETY: no callbacks, so nothing is called with the null context.
    let _ = unsafe { pinpool_snapshot(0, 0, 1, std::ptr::null_mut(), None, None) };
    // SAFETY: a null path is refused before it is read.
    assert_eq!(unsafe { pinpool_dump_snapshot(std::ptr::null()) }, -1);
    // SAFETY: a null filter is refused; there is no context to release.
    let begun =
        unsafe { pinpool_begin_allocate_to_pool(0, 0, 1, None, std::ptr::null_mut(), None) };
    assert_eq!(begun, -1);
    assert_eq!(pinpool_end_allocate_to_pool(99, 0, 1), -1);
    assert_eq!(pinpool_release_pool(99, 0, 1), -1);
    let mut buf = [0u8; 64];
    // SAFETY: `buf` has 64 bytes.
    let _ = unsafe { pinpool_last_error(buf.as_mut_ptr().cast(), buf.len()) };
    let _ = pinpool_failures();
}

#[cfg(unix)]
#[test]
fn every_export_fails_cleanly_while_stderr_is_a_closed_pipe() {
    let case = "case_every_export_with_stderr_closed";
    assert_passed(case, &run_alone(case, closed_pipe()));
}

#[test]
#[ignore = "run alone, in a child process, by the test above"]
fn case_every_export_with_stderr_closed() {
    if !running("case_every_export_with_stderr_closed") {
        return;
    }
    call_every_export();
    // Failures past the first ones are not written: enough were, into the closed pipe.
    assert!(abi::failures() >= abi::LOUD_ERRORS, "{}", abi::failures());
}

#[test]
fn an_export_called_while_its_thread_exits_fails_cleanly() {
    let case = "case_export_at_thread_exit";
    assert_passed(case, &run_alone(case, Stdio::piped()));
}

#[test]
#[ignore = "run alone, in a child process, by the test above"]
fn case_export_at_thread_exit() {
    if !running("case_export_at_thread_exit") {
        return;
    }
    struct CallsAtExit;
    impl Drop for CallsAtExit {
        fn drop(&mut self) {
            // Thread-locals go in the reverse order of their first use: the last error's
            // storage is gone by now.
            call_every_export();
        }
    }
    thread_local! {
        static AT_EXIT: CallsAtExit = const { CallsAtExit };
    }
    std::thread::spawn(|| {
        AT_EXIT.with(|_| ());
        // A failure: the last error's storage is used from here on.
        assert!(pinpool_alloc(MIB, 99, std::ptr::null_mut()).is_null());
    })
    .join()
    .unwrap();
}

#[cfg(not(feature = "cuda"))]
#[test]
fn every_export_survives_a_panic_inside_it() {
    let case = "case_every_export_panics";
    assert_passed(case, &run_alone(case, Stdio::piped()));
}

#[cfg(not(feature = "cuda"))]
#[test]
#[ignore = "run alone, in a child process, by the test above"]
fn case_every_export_panics() {
    if !running("case_every_export_panics") {
        return;
    }
    // Every call of the backend (making the plugin, keeping the thread's context, finding
    // a pointer's device, running a future) panics.
    PANIC.store(true, std::sync::atomic::Ordering::Relaxed);
    call_every_export();
    assert!(
        abi::last_error().contains("panicked: injected panic"),
        "{}",
        abi::last_error()
    );
}
