/*
 * Guarded LMDB reads: every LMDB call that touches an environment's memory
 * map runs here, under sigsetjmp, so that a SIGBUS (the file was truncated
 * under the map) or a SIGSEGV (a corrupt page sends LMDB outside the map)
 * turns into an error code for that call instead of killing the process.
 *
 * The handler only longjmps when the faulting thread is inside one of the
 * functions below (a thread-local jump buffer is set); the jump then crosses
 * only C frames of this file and of LMDB's mdb.c, never Rust frames. Any
 * other fault is passed to the handler installed before ours (Rust's stack
 * overflow handler) or to the default action, so genuine crashes still crash.
 *
 * The LMDB prototypes used are declared here; the library itself is the one
 * lmdb-master-sys compiles (LMDB 0.9, mdb.master, mdb_size_t == size_t).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>

typedef struct MDB_env MDB_env;
typedef struct MDB_txn MDB_txn;
typedef struct MDB_cursor MDB_cursor;
typedef unsigned int MDB_dbi;
typedef struct MDB_val {
    size_t mv_size;
    void *mv_data;
} MDB_val;
typedef struct MDB_stat {
    unsigned int ms_psize;
    unsigned int ms_depth;
    size_t ms_branch_pages;
    size_t ms_leaf_pages;
    size_t ms_overflow_pages;
    size_t ms_entries;
} MDB_stat;
typedef struct MDB_envinfo {
    void *me_mapaddr;
    size_t me_mapsize;
    size_t me_last_pgno;
    size_t me_last_txnid;
    unsigned int me_maxreaders;
    unsigned int me_numreaders;
} MDB_envinfo;
typedef void MDB_assert_func(MDB_env *env, const char *msg);

#define MDB_RDONLY 0x20000
#define MDB_FIRST 0
#define MDB_NEXT 8

int mdb_env_create(MDB_env **env);
int mdb_env_open(MDB_env *env, const char *path, unsigned int flags, unsigned int mode);
void mdb_env_close(MDB_env *env);
int mdb_env_set_assert(MDB_env *env, MDB_assert_func *func);
int mdb_env_info(MDB_env *env, MDB_envinfo *stat);
size_t mdb_txn_id(MDB_txn *txn);
int mdb_txn_begin(MDB_env *env, MDB_txn *parent, unsigned int flags, MDB_txn **txn);
void mdb_txn_abort(MDB_txn *txn);
int mdb_dbi_open(MDB_txn *txn, const char *name, unsigned int flags, MDB_dbi *dbi);
int mdb_stat(MDB_txn *txn, MDB_dbi dbi, MDB_stat *stat);
int mdb_get(MDB_txn *txn, MDB_dbi dbi, MDB_val *key, MDB_val *data);
int mdb_cursor_open(MDB_txn *txn, MDB_dbi dbi, MDB_cursor **cursor);
void mdb_cursor_close(MDB_cursor *cursor);
int mdb_cursor_get(MDB_cursor *cursor, MDB_val *key, MDB_val *data, int op);

/* Codes returned when a guarded call was cut short (outside LMDB's range). */
#define STOKER_SIGBUS (-31001)
#define STOKER_SIGSEGV (-31002)
#define STOKER_ASSERT (-31003)
#define STOKER_KEY_TOO_LONG (-31004)

/* Set while this thread runs a guarded call; the handler jumps there. */
static __thread sigjmp_buf *volatile guard_jmp __attribute__((tls_model("initial-exec")));
/* Where the last cut-short call faulted, and LMDB's assertion text. */
static __thread void *fault_addr __attribute__((tls_model("initial-exec")));
static __thread char assert_msg[256] __attribute__((tls_model("initial-exec")));

static struct sigaction prev_bus, prev_segv;

static void pass_on(int sig, siginfo_t *info, void *ctx) {
    struct sigaction *prev = sig == SIGBUS ? &prev_bus : &prev_segv;
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction != NULL) {
            prev->sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN) {
        prev->sa_handler(sig);
        return;
    }
    /* Default action: returning re-executes the faulting instruction, which
     * now faults with the default disposition (terminate, core dump). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
}

static void on_fault(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *jmp = guard_jmp;
    /* Only faults the kernel raised (si_code > 0), not kill(2)/tgkill(2). */
    if (jmp != NULL && info != NULL && info->si_code > 0) {
        guard_jmp = NULL;
        fault_addr = info->si_addr;
        siglongjmp(*jmp, sig == SIGBUS ? STOKER_SIGBUS : STOKER_SIGSEGV);
    }
    pass_on(sig, info, ctx);
}

static void on_assert(MDB_env *env, const char *msg) {
    (void)env;
    sigjmp_buf *jmp = guard_jmp;
    if (jmp != NULL) {
        guard_jmp = NULL;
        strncpy(assert_msg, msg != NULL ? msg : "", sizeof assert_msg - 1);
        assert_msg[sizeof assert_msg - 1] = 0;
        siglongjmp(*jmp, STOKER_ASSERT);
    }
    /* Outside a guarded call LMDB aborts after this returns. */
}

/* Installs the SIGBUS/SIGSEGV handler; returns 0 or an errno. Called once. */
int stoker_guard_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    /* SA_NODEFER: the signal is not blocked while handling, so jumping out
     * without restoring the mask (sigsetjmp(..., 0), no syscall per call)
     * leaves the thread able to take the next fault. */
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &prev_bus) != 0) return errno;
    if (sigaction(SIGSEGV, &sa, &prev_segv) != 0) return errno;
    return 0;
}

void *stoker_guard_fault_addr(void) { return fault_addr; }
const char *stoker_guard_assert_msg(void) { return assert_msg; }

/*
 * GUARD runs its argument with the handler armed. Locals assigned inside `body`
 * and read after a jump must be volatile; the functions below only write
 * through out-pointers, and only on success.
 */
#define GUARD(...)                                                     \
    do {                                                               \
        sigjmp_buf jmp_;                                               \
        int code_ = sigsetjmp(jmp_, 0);                                \
        if (code_ != 0) return code_;                                  \
        guard_jmp = &jmp_;                                             \
        __atomic_signal_fence(__ATOMIC_SEQ_CST);                       \
        __VA_ARGS__;                                                   \
        __atomic_signal_fence(__ATOMIC_SEQ_CST);                       \
        guard_jmp = NULL;                                              \
    } while (0)

/* Opens an environment read-only; *env is set (and must be closed) even on error. */
int stoker_env_open(const char *path, unsigned int flags, MDB_env **env, MDB_dbi *dbi) {
    int rc = mdb_env_create(env);
    if (rc != 0) {
        *env = NULL;
        return rc;
    }
    mdb_env_set_assert(*env, on_assert);
    MDB_env *e = *env;
    GUARD({
        rc = mdb_env_open(e, path, flags, 0644);
        if (rc == 0) {
            MDB_txn *txn = NULL;
            rc = mdb_txn_begin(e, NULL, MDB_RDONLY, &txn);
            if (rc == 0) {
                rc = mdb_dbi_open(txn, NULL, 0, dbi);
                mdb_txn_abort(txn);
            }
        }
    });
    return rc;
}

void stoker_env_close(MDB_env *env) { mdb_env_close(env); }

/* What a read transaction sees of the file; a file not written while served never changes it. */
typedef struct stoker_snapshot {
    size_t txnid;
    size_t last_pgno;
    size_t entries;
    size_t pages;
    unsigned int psize;
    unsigned int depth;
} stoker_snapshot;

/* Fills *snap for `txn` (reads the meta pages through mdb_env_info). */
static int snapshot(MDB_env *env, MDB_txn *txn, MDB_dbi dbi, stoker_snapshot *snap) {
    MDB_envinfo info;
    MDB_stat st;
    int rc = mdb_env_info(env, &info);
    if (rc == 0) rc = mdb_stat(txn, dbi, &st);
    if (rc == 0) {
        snap->txnid = mdb_txn_id(txn);
        snap->last_pgno = info.me_last_pgno;
        snap->entries = st.ms_entries;
        snap->pages = st.ms_branch_pages + st.ms_leaf_pages + st.ms_overflow_pages;
        snap->psize = st.ms_psize;
        snap->depth = st.ms_depth;
    }
    return rc;
}

/* Begins a read transaction and describes what it sees; *txn is set (to abort) whenever it began. */
int stoker_txn_begin(MDB_env *env, MDB_dbi dbi, MDB_txn **txn, stoker_snapshot *snap) {
    int rc = 0;
    *txn = NULL;
    GUARD({
        rc = mdb_txn_begin(env, NULL, MDB_RDONLY, txn);
        if (rc == 0) rc = snapshot(env, *txn, dbi, snap);
    });
    return rc;
}

void stoker_txn_abort(MDB_txn *txn) { mdb_txn_abort(txn); }

/* Looks `key` up; on success data and len locate the value inside the map. */
int stoker_get(MDB_txn *txn, MDB_dbi dbi, const void *key, size_t key_len, const void **data, size_t *len) {
    int rc = 0;
    GUARD({
        MDB_val k = {key_len, (void *)key};
        MDB_val v = {0, NULL};
        rc = mdb_get(txn, dbi, &k, &v);
        if (rc == 0) {
            *data = v.mv_data;
            *len = v.mv_size;
        }
    });
    return rc;
}

/* Copies `len` bytes of the map at `src` to `dst`. */
int stoker_copy(void *dst, const void *src, size_t len) {
    GUARD(memcpy(dst, src, len));
    return 0;
}

int stoker_cursor_open(MDB_txn *txn, MDB_dbi dbi, MDB_cursor **cursor) {
    int rc = 0;
    GUARD(rc = mdb_cursor_open(txn, dbi, cursor));
    return rc;
}

void stoker_cursor_close(MDB_cursor *cursor) { mdb_cursor_close(cursor); }

/*
 * Moves to the first (first != 0) or next entry, copies its key into
 * key_buf (key_cap bytes; STOKER_KEY_TOO_LONG with *key_len set if it does
 * not fit) and, when `data` is not NULL, locates its value inside the map
 * (without it, the value's overflow pages are not touched).
 */
int stoker_cursor_next(MDB_cursor *cursor, int first, void *key_buf, size_t key_cap, size_t *key_len,
                       const void **data, size_t *len) {
    int rc = 0;
    GUARD({
        MDB_val k = {0, NULL};
        MDB_val v = {0, NULL};
        rc = mdb_cursor_get(cursor, &k, data != NULL ? &v : NULL, first ? MDB_FIRST : MDB_NEXT);
        if (rc == 0) {
            *key_len = k.mv_size;
            if (k.mv_size > key_cap) {
                rc = STOKER_KEY_TOO_LONG;
            } else {
                memcpy(key_buf, k.mv_data, k.mv_size);
                if (data != NULL) {
                    *data = v.mv_data;
                    *len = v.mv_size;
                }
            }
        }
    });
    return rc;
}
