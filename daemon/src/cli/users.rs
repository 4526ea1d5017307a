//! User names for the uids `stoker status` shows: the password file, then
//! `getent passwd` (bounded in time), each uid looked up once.

use std::collections::HashMap;

use stoker_proto::StatusReport;

/// User names by uid, looked up once each: `/etc/passwd`, then `getent passwd`
/// (LDAP or SSSD users on a cluster), else the number.
#[derive(Debug, Default)]
pub(super) struct Users(HashMap<u32, String>);

impl Users {
    /// The names of the users in `report`.
    pub(super) fn names(&mut self, report: &StatusReport) -> HashMap<u32, String> {
        for c in &report.clients {
            self.0.entry(c.uid).or_insert_with(|| user_name(c.uid).unwrap_or_else(|| c.uid.to_string()));
        }
        self.0.clone()
    }
}

/// The login name of `uid`, if the password database knows it.
fn user_name(uid: u32) -> Option<String> {
    let from_passwd = |text: &str| {
        text.lines().find_map(|line| {
            let mut parts = line.split(':');
            let name = parts.next()?;
            (parts.nth(1)?.parse() == Ok(uid)).then(|| name.to_string())
        })
    };
    if let Some(name) = std::fs::read_to_string("/etc/passwd").ok().as_deref().and_then(from_passwd) {
        return Some(name);
    }
    // A name service that hangs must not hang `status`: give getent two seconds.
    let mut child = std::process::Command::new("getent")
        .args(["passwd", &uid.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while child.try_wait().ok()?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let mut text = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take()?, &mut text).ok()?;
    from_passwd(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_names_come_from_the_password_database() {
        assert_eq!(user_name(0).as_deref(), Some("root"));
    }
}
