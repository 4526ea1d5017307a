//! Cancelling an open whose client has gone.
//!
//! Opening a dataset runs on one blocking thread, as the client: a glob walk
//! or a long list of files can take a while, and a client that gave up (its
//! connection closed) should not keep a daemon thread busy for it. The
//! daemon sets a [`Scope`] around the open with its connection's flag; the
//! long loops below ask [`cancelled`] and stop with an error that is never
//! seen (nobody is left to read it).

use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

thread_local! {
    static FLAG: RefCell<Option<Arc<AtomicBool>>> = const { RefCell::new(None) };
}

/// While alive, [`cancelled`] on this thread reads `flag`.
#[derive(Debug)]
pub struct Scope {
    previous: Option<Arc<AtomicBool>>,
}

impl Scope {
    /// Work on this thread is cancelled once `flag` is set.
    pub fn enter(flag: Arc<AtomicBool>) -> Scope {
        Scope { previous: FLAG.with(|f| f.borrow_mut().replace(flag)) }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        let previous = self.previous.take();
        FLAG.with(|f| *f.borrow_mut() = previous);
    }
}

/// Whether the work on this thread was cancelled (its client left).
pub fn cancelled() -> bool {
    FLAG.with(|f| f.borrow().as_ref().is_some_and(|flag| flag.load(Ordering::Relaxed)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_scope_sets_and_restores_the_flag() {
        assert!(!cancelled());
        let flag = Arc::new(AtomicBool::new(false));
        {
            let _scope = Scope::enter(flag.clone());
            assert!(!cancelled());
            flag.store(true, Ordering::Relaxed);
            assert!(cancelled());
        }
        assert!(!cancelled());
    }
}
