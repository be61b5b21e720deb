//! Nodes: the roster (declared and enrolled, with each one's lifecycle state), approval and
//! revocation, the evidence agents send, desired versus applied status, and the audit chain.

use std::collections::{BTreeMap, HashMap};

use sha2::{Digest, Sha256};
use trellis_core::decl::PublicKey;
use trellis_proto as proto;
use trellis_proto::{AuditAction, EnrolledState, NodeState};
use trellis_store::{Audit, NodeRecord, StoreError};

use crate::{Controller, Error, NodeIdentity, Result};

/// A node the controller knows of, declared or enrolled (or both), with its lifecycle state.
pub struct RosterEntry {
    pub name: String,
    pub state: NodeState,
    pub declared_key: Option<PublicKey>,
    pub record: Option<NodeRecord>,
    /// For a revoked node: how far its revocation has reached.
    pub revocation: Option<proto::Revocation>,
}

/// The longest error an evidence record keeps, in bytes, and the most files it may list (a
/// bundle carries six).
pub const MAX_EVIDENCE_ERROR: usize = 4096;
pub const MAX_EVIDENCE_FILES: usize = 64;

/// `s` cut to at most `max` bytes on a character boundary, marked when cut.
fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… (cut at {max} bytes)", &s[..end])
}

fn key_fingerprint(key: &str) -> Option<String> {
    PublicKey::parse(key).map(|k| hex::encode(&Sha256::digest(k.0)[..8]))
}

impl Controller {
    /// Every node, in name order, a revoked node `revoking` with its revocation until that is
    /// complete (ADR 0022).
    pub async fn roster(&self) -> Result<Vec<RosterEntry>> {
        Ok(self.roster_and_revocations().await?.0)
    }

    /// The roster, and every revocation followed, by node (those of revoked members the sweep
    /// removed since included).
    pub(crate) async fn roster_and_revocations(&self) -> Result<(Vec<RosterEntry>, BTreeMap<String, proto::Revocation>)> {
        let mut roster = self.roster_entries().await?;
        let views = self.revocation_view(&roster).await?;
        for e in &mut roster {
            if let Some(v) = views.get(&e.name) {
                if e.state == NodeState::Revoked && !v.complete() {
                    e.state = NodeState::Revoking;
                }
                e.revocation = Some(v.clone());
            }
        }
        // A member the sweep removed (revoked or out of contact) has no record left: it stays
        // listed while its peers still hold its key.
        let listed: std::collections::HashSet<String> = roster.iter().map(|e| e.name.clone()).collect();
        // Routes withdrawn from a node are followed on the node while it is listed; a node
        // gone is a revocation's or removal's.
        let kept = |v: &&proto::Revocation| v.kind != proto::Withdrawal::Routes;
        let gone = views.values().filter(|v| !v.complete() && !listed.contains(&v.node)).filter(kept).map(|v| RosterEntry {
            name: v.node.clone(),
            state: match v.kind {
                proto::Withdrawal::Revocation => NodeState::Revoking,
                proto::Withdrawal::Removal | proto::Withdrawal::Routes => NodeState::Removing,
            },
            declared_key: None,
            record: None,
            revocation: Some(v.clone()),
        });
        let gone: Vec<RosterEntry> = gone.collect();
        if !gone.is_empty() {
            roster.extend(gone);
            roster.sort_by(|a, b| a.name.cmp(&b.name));
        }
        Ok((roster, views))
    }

    /// Every node, in name order, with the state its record and the declaration give it.
    /// Contacts held in memory are written first, so they show.
    pub(crate) async fn roster_entries(&self) -> Result<Vec<RosterEntry>> {
        self.flush_contacts().await;
        let records = self.store.nodes().await?;
        // Indexed: every name is looked up in it.
        let decl = self.current_declaration().await?.map(|(rev, d)| trellis_core::decl::Indexed::new(self.with_members(rev, d, &records)));
        let mut records: HashMap<String, NodeRecord> = records.into_iter().map(|r| (r.name.clone(), r)).collect();
        let mut names: Vec<String> = decl.iter().flat_map(|d| d.decl().nodes.iter().map(|n| n.name.clone())).collect();
        names.extend(records.keys().cloned());
        names.sort();
        names.dedup();
        Ok(names
            .into_iter()
            .map(|name| {
                let declared = decl.as_ref().and_then(|d| d.node(&name));
                let record = records.remove(&name);
                let state = match (declared, &record) {
                    (None, _) => NodeState::Removed,
                    (Some(n), None) if n.public_key.is_some() => NodeState::External,
                    (Some(_), None) => NodeState::Declared,
                    (Some(_), Some(r)) => r.state.into(),
                };
                RosterEntry { state, declared_key: declared.and_then(|n| n.public_key), record, name, revocation: None }
            })
            .collect())
    }

    pub async fn nodes(&self) -> Result<Vec<proto::NodeInfo>> {
        let alloc = self.store.allocation().await?;
        let mut agents = self.store.agents().await?;
        Ok(self
            .roster()
            .await?
            .into_iter()
            .map(|e| {
                let key = e.declared_key.map(|k| k.to_string()).or_else(|| e.record.as_ref().and_then(|r| r.wg_public_key.clone()));
                proto::NodeInfo {
                    // A pool's member holds the addresses it was given when it enrolled.
                    ipv4: alloc.ipv4.get(&e.name).map(|a| a.to_string()).or_else(|| e.record.as_ref().and_then(|r| r.ipv4.clone())),
                    ipv6: alloc.ipv6.get(&e.name).map(|a| a.to_string()).or_else(|| e.record.as_ref().and_then(|r| r.ipv6.clone())),
                    pool: e.record.as_ref().and_then(|r| r.pool.clone()),
                    key_fingerprint: key.as_deref().and_then(key_fingerprint),
                    wireguard_public_key: key,
                    cert_not_after: e.record.as_ref().and_then(|r| r.cert_not_after),
                    last_contact: e.record.as_ref().and_then(|r| r.last_contact),
                    agent_protocol: agents.get(&e.name).map(|(p, _)| p.clone()),
                    agent_release: agents.remove(&e.name).map(|(_, r)| r),
                    name: e.name,
                    state: e.state,
                    revocation: e.revocation,
                }
            })
            .collect())
    }

    /// What a node's request says of its agent: the protocol it speaks (`None`: an agent older than
    /// the header, which spoke 1.0), its release and its clock. A major this controller does not
    /// speak is refused, naming the node and both versions; a clock further than
    /// [`MAX_SKEW_SECS`](trellis_proto::version::MAX_SKEW_SECS) from the controller's is refused,
    /// naming the skew; what changed since the node last said is recorded, for `trellis nodes`,
    /// and then an agent older than the declaration's `min_agent_version` is refused, naming its
    /// release and the minimum (recorded first, so `trellis status` can say which nodes it is).
    pub async fn hello(&self, who: &NodeIdentity, protocol: Option<&str>, release: Option<&str>, time: Option<&str>) -> Result<()> {
        use trellis_proto::version::{plain_release, Protocol, PROTOCOL};
        let theirs: Protocol = match protocol {
            Some(p) => p.parse().map_err(|e: String| Error::BadRequest(format!("the Trellis-Protocol header: {e}")))?,
            None => Protocol { major: 1, minor: 0 },
        };
        let release = match release {
            Some(r) if plain_release(r) => r,
            Some(_) => {
                return Err(Error::BadRequest(format!(
                    "the Trellis-Agent header is not a release (at most {} characters of letters, digits and .-+~_)",
                    trellis_proto::version::MAX_RELEASE
                )))
            }
            None => "unknown",
        };
        if theirs.major != PROTOCOL.major {
            return Err(Error::ProtocolUnsupported { node: who.name.clone(), theirs, release: release.to_string(), ours: PROTOCOL });
        }
        self.note_clock(&who.name, time)?;
        let said = (theirs.to_string(), release.to_string());
        let changed = self.agents.lock().expect("agents").get(&who.name) != Some(&said);
        if changed {
            self.store.set_agent(&who.name, &said.0, &said.1).await?;
            self.agents.lock().expect("agents").insert(who.name.clone(), said);
        }
        if let Some(min) = self.min_agent_version().await? {
            if let Some(sentence) = too_old(&who.name, release, &min) {
                return Err(sentence);
            }
        }
        Ok(())
    }

    /// Refuses the clock (`Trellis-Time`, Unix seconds) of a node that enrols when it is further
    /// than [`MAX_SKEW_SECS`](trellis_proto::version::MAX_SKEW_SECS) from the controller's,
    /// naming the skew: the certificate it would be given would not be valid on its clock. A
    /// request without the header comes from an agent older than it: not checked.
    pub fn check_clock(&self, node: &str, time: Option<&str>) -> Result<()> {
        use trellis_proto::version::{skew_words, MAX_SKEW_SECS};
        let Some(theirs) = node_time(time)? else { return Ok(()) };
        let now = self.now();
        if (theirs - now).abs() > MAX_SKEW_SECS {
            return Err(Error::ClockSkew { node: node.to_string(), skew: skew_words(theirs, now) });
        }
        Ok(())
    }

    /// Notes an enrolled node's clock: further than the bound from the controller's, it is
    /// shown by `trellis status` and warned of once, and the request is served. A clock fault
    /// (the node's or the controller's) must not stop renewals, bundles or evidence: refused,
    /// every node's certificate would expire and the whole fleet would have to enrol again.
    fn note_clock(&self, node: &str, time: Option<&str>) -> Result<()> {
        use trellis_proto::version::{skew_words, MAX_SKEW_SECS};
        let Some(theirs) = node_time(time)? else { return Ok(()) };
        let now = self.now();
        let mut skews = self.skews.lock().expect("skews");
        if (theirs - now).abs() > MAX_SKEW_SECS {
            if skews.insert(node.to_string(), theirs - now).is_none() {
                tracing::warn!(node, "{}", skew_sentence(node, theirs - now));
            }
        } else if skews.remove(node).is_some() {
            tracing::info!(
                node,
                "the clock of node `{node}` is within {MAX_SKEW_SECS} s of the controller's again ({})",
                skew_words(theirs, now)
            );
        }
        Ok(())
    }

    /// The sentence `trellis status` shows of a node whose clock is `skew` seconds off, if it is
    /// further than tolerated.
    fn clock_skew(&self, node: &str) -> Option<String> {
        self.skews.lock().expect("skews").get(node).map(|&skew| skew_sentence(node, skew))
    }

    /// The current declaration's `min_agent_version`, from the declaration the last publish run
    /// parsed (every node request asks; only before the first run does it read the database).
    async fn min_agent_version(&self) -> Result<Option<trellis_core::release::Release>> {
        if let Some((_, d)) = self.declaration.lock().await.as_ref() {
            return Ok(d.decl().mesh.min_agent_version.clone());
        }
        Ok(self.current_declaration().await?.and_then(|(_, d)| d.mesh.min_agent_version.clone()))
    }

    /// Lets a node that enrolled pending approval take part.
    pub async fn approve(&self, name: &str) -> Result<proto::WhoAmI> {
        let audit = Audit { at: self.now(), actor: "admin", action: AuditAction::NodeApproved, subject: name, detail: String::new() };
        self.store.set_state(name, &[EnrolledState::Pending], EnrolledState::Active, &audit).await.map_err(|e| match e {
            StoreError::NotFound(_) => Error::NotPending(name.to_string()),
            other => other.into(),
        })?;
        self.publisher.set_state(name, EnrolledState::Active);
        self.ask_publish();
        Ok(proto::WhoAmI { node: name.to_string(), state: EnrolledState::Active })
    }

    /// Revokes a node: its certificates are refused on its next request, and its peers drop it;
    /// it is `revoking` until every node that held its key applied a bundle without it. A node
    /// revoked already is answered as it is, with nothing decided again: a retried revocation
    /// (its answer lost, a script run twice) succeeds, and `--wait` follows it.
    pub async fn revoke(&self, name: &str) -> Result<proto::WhoAmI> {
        let audit = Audit { at: self.now(), actor: "admin", action: AuditAction::NodeRevoked, subject: name, detail: String::new() };
        let decided = self.store.set_state(name, &[EnrolledState::Pending, EnrolledState::Active], EnrolledState::Revoked, &audit).await;
        match decided {
            Ok(_) => {}
            Err(StoreError::NotFound(_)) => {
                return match self.store.node(name).await? {
                    Some(r) if r.state == EnrolledState::Revoked => {
                        Ok(proto::WhoAmI { node: name.to_string(), state: EnrolledState::Revoked })
                    }
                    _ => Err(Error::NotRevocable(name.to_string())),
                };
            }
            Err(other) => return Err(other.into()),
        }
        self.publisher.set_state(name, EnrolledState::Revoked);
        let record = self.store.node(name).await?;
        self.remember(crate::ledger::Entry::Node {
            name: name.to_string(),
            key: record.as_ref().and_then(|r| r.wg_public_key.clone()),
            serial: record.as_ref().and_then(|r| r.cert_serial.clone()),
            at: audit.at,
        });
        self.ask_publish();
        Ok(proto::WhoAmI { node: name.to_string(), state: EnrolledState::Revoked })
    }

    /// Appends what a node reports it did; re-sent records are counted, not stored twice.
    /// Evidence never changes desired state.
    pub async fn evidence(&self, who: &NodeIdentity, batch: &proto::EvidenceBatch) -> Result<proto::EvidenceAck> {
        if batch.records.len() > proto::MAX_EVIDENCE_BATCH {
            return Err(Error::TooLarge(format!("an evidence batch holds at most {} records", proto::MAX_EVIDENCE_BATCH)));
        }
        self.require_approved(who)?;
        // A node reports on versions it was given: one above its newest would show as applied
        // for ever. The version held in memory answers almost always; the database only when a
        // record is above it (another replica may have published since this one last looked).
        let mut newest = self.publisher.current(&who.name).map_or(0, |p| p.version);
        if batch.records.iter().any(|r| r.version > newest) {
            newest = self.store.bundle(&who.name).await?.map_or(0, |b| b.version);
        }
        let mut records = Vec::with_capacity(batch.records.len());
        for r in &batch.records {
            if r.seq < 1 || r.version < 1 {
                return Err(Error::BadRequest(format!("evidence record {}: sequence numbers and versions start at 1", r.seq)));
            }
            if r.version > newest {
                return Err(Error::BadRequest(format!(
                    "evidence record {}: version {} was never published for node `{}` (its newest is {newest})",
                    r.seq, r.version, who.name
                )));
            }
            if r.files.len() > MAX_EVIDENCE_FILES {
                return Err(Error::BadRequest(format!("evidence record {}: it lists more than {MAX_EVIDENCE_FILES} files", r.seq)));
            }
            records.push(trellis_store::EvidenceRecord {
                seq: r.seq,
                version: r.version,
                result: r.result,
                // An error is a sentence for the operator; a longer one is cut, not stored whole.
                error: r.error.as_deref().map(|e| bounded(e, MAX_EVIDENCE_ERROR)),
                files: serde_json::to_string(&r.files).map_err(|e| Error::internal("recording evidence", e))?,
                at: r.at,
                unmanaged: r.unmanaged,
            });
        }
        let (accepted, duplicates) = self.store.add_evidence(&who.name, &records, self.now()).await?;
        self.rotation_evidence();
        self.evidence_arrived();
        Ok(proto::EvidenceAck { accepted, duplicates })
    }

    /// Every node with its desired and applied versions, staleness and evidence.
    pub async fn status(&self) -> Result<Vec<proto::NodeStatus>> {
        self.status_with(true).await
    }

    /// As [`status`](Self::status); without `paths`, no node lists its relayed pairs (millions at
    /// 100,000 nodes: a metrics scrape counts them from the pairs instead, `paths::path_counts`).
    pub(crate) async fn status_with(&self, paths: bool) -> Result<Vec<proto::NodeStatus>> {
        let roster = self.roster().await?;
        let min = self.current_declaration().await?.and_then(|(_, d)| d.mesh.min_agent_version.clone());
        let agents = if min.is_some() { self.store.agents().await? } else { Default::default() };
        let bundles = self.store.bundles().await?;
        let evidence = self.store.evidence_summary().await?;
        let mut ingress = self.ingress_states().await?;
        // What the agents said of their paths matters only to the pairs listed.
        let path_reports = if paths { self.path_reports().await? } else { HashMap::new() };
        let pairs = if paths { self.publisher.relayed_pairs().await } else { Vec::new() };
        let pairs = crate::paths::by_node(&pairs);
        let t = self.now();
        Ok(roster
            .into_iter()
            .map(|e| {
                let b = bundles.get(&e.name).filter(|_| e.state == NodeState::Active);
                let ev = evidence.get(&e.name);
                let applied = ev.and_then(|ev| ev.applied_version);
                // Applied above the desired version is stale too: the node holds a bundle this
                // database never gave it (restored from an older backup), until it asks again.
                let stale = b.is_some_and(|b| applied.is_none_or(|a| a != b.version));
                proto::NodeStatus {
                    desired_version: b.map(|b| b.version),
                    applied_version: applied,
                    last_contact: e.record.as_ref().and_then(|r| r.last_contact),
                    cert_not_after: e.record.as_ref().and_then(|r| r.cert_not_after),
                    stale,
                    stale_for: b.filter(|_| stale).map(|b| t - b.issued_at),
                    last_result: ev.and_then(|ev| ev.last_result),
                    last_error: ev.and_then(|ev| ev.last_error.clone()),
                    evidence_records: ev.map_or(0, |ev| ev.records),
                    evidence_missing: ev.map_or(0, |ev| ev.missing()),
                    revocation: e.revocation,
                    // A node whose agent is older than the minimum is refused on every request
                    // (its last word is what it said then).
                    agent_refused: min
                        .as_ref()
                        .zip(agents.get(&e.name))
                        .filter(|_| e.state == NodeState::Active || e.state == NodeState::Pending)
                        .and_then(|(min, (_, release))| too_old(&e.name, release, min))
                        .map(|refusal| refusal.to_string()),
                    ingress: ingress.remove(&e.name),
                    paths: crate::paths::pair_paths(
                        &e.name,
                        pairs.get(e.name.as_str()).map_or(&[], Vec::as_slice),
                        path_reports.get(&e.name),
                    ),
                    clock_skew: self.clock_skew(&e.name),
                    state: e.state,
                    name: e.name,
                }
            })
            .collect())
    }

    /// The whole audit chain (in process; over HTTP it is read by [`Controller::audit_page`]).
    pub async fn audit(&self) -> Result<Vec<proto::AuditRecord>> {
        Ok(self.store.audit().await?)
    }

    /// At most `limit` audit records after sequence number `after` (0: from the first), oldest
    /// first; `limit` is held to 1..=[`proto::AUDIT_PAGE`].
    pub async fn audit_page(&self, after: i64, limit: i64) -> Result<Vec<proto::AuditRecord>> {
        Ok(self.store.audit_page(after.max(0), limit.clamp(1, proto::AUDIT_PAGE)).await?)
    }
}

/// The refusal of an agent of `release` under the minimum `min`, if it is older (a release that
/// names no version, as an agent older than the header's, is older than any).
fn too_old(node: &str, release: &str, min: &trellis_core::release::Release) -> Option<Error> {
    let older = release.parse::<trellis_core::release::Release>().map_or(true, |r| r < *min);
    older.then(|| Error::AgentTooOld { node: node.to_string(), release: release.to_string(), min: min.to_string() })
}

/// The time a node's `Trellis-Time` header says, if it has one.
fn node_time(time: Option<&str>) -> Result<Option<i64>> {
    let Some(time) = time else { return Ok(None) };
    time.parse()
        .ok()
        .filter(|t: &i64| (0..1 << 40).contains(t))
        .map(Some)
        .ok_or_else(|| Error::BadRequest("the Trellis-Time header is not a time (Unix seconds)".into()))
}

/// What is said of a node whose clock is `skew` seconds ahead (behind when negative) of the
/// controller's.
fn skew_sentence(node: &str, skew: i64) -> String {
    use trellis_proto::version::{skew_words, MAX_SKEW_SECS};
    format!(
        "the clock of node `{node}` is {} the controller's, more than the {MAX_SKEW_SECS} s tolerated: set the clocks (NTP); its requests are still served",
        skew_words(skew, 0)
    )
}
