//! One game: its fixed map, objects and quest ([`World`]), the part that commands change
//! ([`State`]), the admissible commands in a state, their effects, and the shortest win (BFS).

use std::collections::{HashSet, VecDeque};

/// A compass direction; exits are indexed by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Dir {
    North,
    East,
    South,
    West,
}

impl Dir {
    /// All four, in the order exits are stored and described.
    pub(super) const ALL: [Dir; 4] = [Dir::North, Dir::East, Dir::South, Dir::West];

    pub(super) fn name(self) -> &'static str {
        match self {
            Dir::North => "north",
            Dir::East => "east",
            Dir::South => "south",
            Dir::West => "west",
        }
    }

    pub(super) fn opposite(self) -> Dir {
        match self {
            Dir::North => Dir::South,
            Dir::East => Dir::West,
            Dir::South => Dir::North,
            Dir::West => Dir::East,
        }
    }

    /// The grid step (x grows east, y grows south).
    pub(super) fn delta(self) -> (i32, i32) {
        match self {
            Dir::North => (0, -1),
            Dir::East => (1, 0),
            Dir::South => (0, 1),
            Dir::West => (-1, 0),
        }
    }
}

/// A way out of a room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Exit {
    /// The room it leads to.
    pub to: usize,
    /// The door on it, if any.
    pub door: Option<usize>,
}

/// A room: name, a sentence of colour, and an exit per direction (`Dir as usize`).
#[derive(Debug, Clone)]
pub(super) struct Room {
    pub name: &'static str,
    pub flavour: &'static str,
    pub exits: [Option<Exit>; 4],
}

impl Room {
    /// The exits that exist, in `Dir::ALL` order.
    pub(super) fn exits(&self) -> impl Iterator<Item = (Dir, Exit)> + '_ {
        Dir::ALL.into_iter().zip(self.exits).filter_map(|(d, e)| e.map(|e| (d, e)))
    }
}

/// What an object is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A portable thing.
    Item,
    /// A portable key for the door with this index.
    Key(usize),
    /// A portable trap: eating it loses the game.
    Rotten,
    /// Fixed furniture that things go "on".
    Supporter,
    /// Fixed furniture that things go "in" (always open).
    Container,
}

impl Kind {
    pub(super) fn is_furniture(self) -> bool {
        matches!(self, Kind::Supporter | Kind::Container)
    }

    pub(super) fn preposition(self) -> &'static str {
        if self == Kind::Container {
            "in"
        } else {
            "on"
        }
    }
}

/// An object; names are unique within a game.
#[derive(Debug, Clone)]
pub(super) struct Object {
    pub name: String,
    pub kind: Kind,
    /// What examining an ordinary item says.
    pub looks: &'static str,
}

/// A door between two rooms; its key, if any, is the object of kind `Key(this door)`.
#[derive(Debug, Clone)]
pub(super) struct Door {
    pub name: String,
}

/// A door's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum DoorState {
    Open,
    Closed,
    Locked,
}

/// Where an object is. Furniture stays on the floor of its room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Loc {
    /// On the floor of this room.
    Floor(usize),
    /// On or in this piece of furniture.
    In(usize),
    /// In the player's hands.
    Held,
    /// Eaten.
    Gone,
}

/// One scored step of the quest: a predicate on the state, reached in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Milestone {
    /// The player holds this object.
    Holding(usize),
    /// This door is not locked.
    Unlocked(usize),
    /// This door is open.
    Opened(usize),
    /// The player is in this room.
    Entered(usize),
    /// This object is on or in this furniture.
    Placed(usize, usize),
}

/// What commands change.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct State {
    /// The player's room.
    pub room: usize,
    /// Where each object is.
    pub locs: Vec<Loc>,
    /// Each door's state.
    pub doors: Vec<DoorState>,
    /// Milestones reached (the score).
    pub progress: usize,
    /// The trap was sprung.
    pub lost: bool,
}

/// A command the game understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Command {
    Look,
    Inventory,
    Go(Dir),
    Take(usize),
    TakeFrom(usize, usize),
    Drop(usize),
    Put(usize, usize),
    Open(usize),
    Close(usize),
    Unlock(usize, usize),
    Lock(usize, usize),
    ExamineObject(usize),
    ExamineDoor(usize),
    Eat(usize),
}

/// The first words of commands, to tell "unknown verb" from "can't do that".
pub(super) const VERBS: [&str; 12] =
    ["look", "inventory", "go", "take", "drop", "put", "open", "close", "unlock", "lock", "examine", "eat"];

/// A generated game (see `generate.rs`): fixed map, objects and quest, and the start state.
#[derive(Debug, Clone)]
pub(super) struct World {
    pub rooms: Vec<Room>,
    pub objects: Vec<Object>,
    pub doors: Vec<Door>,
    pub quest: Vec<Milestone>,
    /// The object to deliver.
    pub target: usize,
    /// The furniture to deliver it to.
    pub goal: usize,
    pub start: State,
}

impl World {
    pub(super) fn won(&self, s: &State) -> bool {
        s.progress >= self.quest.len()
    }

    /// The room an object is in (`None` when held).
    pub(super) fn room_of(&self, s: &State, obj: usize) -> Option<usize> {
        match s.locs[obj] {
            Loc::Floor(r) => Some(r),
            Loc::In(f) => self.room_of(s, f),
            Loc::Held | Loc::Gone => None,
        }
    }

    fn key_of(&self, door: usize) -> Option<usize> {
        self.objects.iter().position(|o| o.kind == Kind::Key(door))
    }

    fn holds(&self, s: &State, m: Milestone) -> bool {
        match m {
            Milestone::Holding(o) => s.locs[o] == Loc::Held,
            Milestone::Unlocked(d) => s.doors[d] != DoorState::Locked,
            Milestone::Opened(d) => s.doors[d] == DoorState::Open,
            Milestone::Entered(r) => s.room == r,
            Milestone::Placed(o, f) => s.locs[o] == Loc::In(f),
        }
    }

    /// Moves the progress past every milestone that now holds, in order; returns the gain.
    pub(super) fn advance(&self, s: &mut State) -> usize {
        let before = s.progress;
        while s.quest_pending(self) && self.holds(s, self.quest[s.progress]) {
            s.progress += 1;
        }
        s.progress - before
    }

    /// The command as the player types it.
    pub(super) fn text(&self, cmd: Command) -> String {
        let obj = |i: usize| self.objects[i].name.as_str();
        let door = |k: usize| self.doors[k].name.as_str();
        match cmd {
            Command::Look => "look".into(),
            Command::Inventory => "inventory".into(),
            Command::Go(d) => format!("go {}", d.name()),
            Command::Take(i) => format!("take {}", obj(i)),
            Command::TakeFrom(i, f) => format!("take {} from {}", obj(i), obj(f)),
            Command::Drop(i) => format!("drop {}", obj(i)),
            Command::Put(i, f) => format!("put {} {} {}", obj(i), self.objects[f].kind.preposition(), obj(f)),
            Command::Open(k) => format!("open {}", door(k)),
            Command::Close(k) => format!("close {}", door(k)),
            Command::Unlock(k, key) => format!("unlock {} with {}", door(k), obj(key)),
            Command::Lock(k, key) => format!("lock {} with {}", door(k), obj(key)),
            Command::ExamineObject(i) => format!("examine {}", obj(i)),
            Command::ExamineDoor(k) => format!("examine {}", door(k)),
            Command::Eat(i) => format!("eat {}", obj(i)),
        }
    }

    /// Every command that does something in `s`, with its text, sorted by text.
    pub(super) fn commands(&self, s: &State) -> Vec<(String, Command)> {
        let mut cmds = vec![Command::Look, Command::Inventory];
        let held = |o: Option<usize>| o.filter(|&o| s.locs[o] == Loc::Held);
        for (d, exit) in self.rooms[s.room].exits() {
            let Some(k) = exit.door else {
                cmds.push(Command::Go(d));
                continue;
            };
            cmds.push(Command::ExamineDoor(k));
            match (s.doors[k], held(self.key_of(k))) {
                (DoorState::Open, _) => cmds.extend([Command::Go(d), Command::Close(k)]),
                (DoorState::Closed, key) => {
                    cmds.push(Command::Open(k));
                    cmds.extend(key.map(|key| Command::Lock(k, key)));
                }
                (DoorState::Locked, key) => cmds.extend(key.map(|key| Command::Unlock(k, key))),
            }
        }
        let here: Vec<usize> = (0..self.objects.len())
            .filter(|&f| self.objects[f].kind.is_furniture() && s.locs[f] == Loc::Floor(s.room))
            .collect();
        for (i, o) in self.objects.iter().enumerate() {
            match s.locs[i] {
                Loc::Held => {
                    cmds.extend([Command::ExamineObject(i), Command::Drop(i)]);
                    cmds.extend(here.iter().map(|&f| Command::Put(i, f)));
                    if o.kind == Kind::Rotten {
                        cmds.push(Command::Eat(i));
                    }
                }
                Loc::Floor(r) if r == s.room => {
                    cmds.push(Command::ExamineObject(i));
                    if !o.kind.is_furniture() {
                        cmds.push(Command::Take(i));
                    }
                }
                Loc::In(f) if here.contains(&f) => {
                    cmds.extend([Command::ExamineObject(i), Command::TakeFrom(i, f)]);
                }
                _ => {}
            }
        }
        let mut out: Vec<(String, Command)> = cmds.into_iter().map(|c| (self.text(c), c)).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Applies an admissible `cmd` to `s` and moves the quest on; returns the score gain.
    pub(super) fn effect(&self, s: &mut State, cmd: Command) -> usize {
        match cmd {
            Command::Look | Command::Inventory | Command::ExamineObject(_) | Command::ExamineDoor(_) => {}
            Command::Go(d) => {
                if let Some(exit) = self.rooms[s.room].exits[d as usize] {
                    s.room = exit.to;
                }
            }
            Command::Take(i) | Command::TakeFrom(i, _) => s.locs[i] = Loc::Held,
            Command::Drop(i) => s.locs[i] = Loc::Floor(s.room),
            Command::Put(i, f) => s.locs[i] = Loc::In(f),
            Command::Open(k) => s.doors[k] = DoorState::Open,
            Command::Close(k) | Command::Unlock(k, _) => s.doors[k] = DoorState::Closed,
            Command::Lock(k, _) => s.doors[k] = DoorState::Locked,
            Command::Eat(i) => {
                s.locs[i] = Loc::Gone;
                s.lost = true;
            }
        }
        if s.lost {
            0
        } else {
            self.advance(s)
        }
    }

    /// Whether a command can be part of a shortest win. Looking, examining, dropping,
    /// closing, locking and eating never are, nor is moving an object other than a key or the
    /// target (nothing has a capacity), so the search skips them: same answer, far fewer states.
    fn may_help(&self, cmd: Command) -> bool {
        let relevant = |i: usize| i == self.target || matches!(self.objects[i].kind, Kind::Key(_));
        match cmd {
            Command::Go(_) | Command::Open(_) | Command::Unlock(..) => true,
            Command::Take(i) | Command::TakeFrom(i, _) | Command::Put(i, _) => relevant(i),
            _ => false,
        }
    }

    /// The shortest winning command sequence from `s` (breadth-first over states reached by
    /// the admissible commands); `Some(vec![])` when already won, `None` when lost or stuck.
    pub(super) fn walkthrough(&self, s: &State) -> Option<Vec<String>> {
        if s.lost {
            return None;
        }
        if self.won(s) {
            return Some(Vec::new());
        }
        // nodes[i] = (state, parent index, command that led here)
        let mut nodes: Vec<(State, usize, Option<Command>)> = vec![(s.clone(), 0, None)];
        let mut seen: HashSet<State> = HashSet::from([s.clone()]);
        let mut queue = VecDeque::from([0usize]);
        while let Some(i) = queue.pop_front() {
            let state = nodes[i].0.clone();
            for (_, cmd) in self.commands(&state) {
                if !self.may_help(cmd) {
                    continue;
                }
                let mut next = state.clone();
                self.effect(&mut next, cmd);
                if next.lost || !seen.insert(next.clone()) {
                    continue;
                }
                let won = self.won(&next);
                nodes.push((next, i, Some(cmd)));
                if won {
                    return Some(self.path_to(&nodes, nodes.len() - 1));
                }
                queue.push_back(nodes.len() - 1);
            }
        }
        None
    }

    fn path_to(&self, nodes: &[(State, usize, Option<Command>)], mut i: usize) -> Vec<String> {
        let mut path = Vec::new();
        while let (_, parent, Some(cmd)) = &nodes[i] {
            path.push(self.text(*cmd));
            i = *parent;
        }
        path.reverse();
        path
    }
}

impl State {
    fn quest_pending(&self, world: &World) -> bool {
        self.progress < world.quest.len()
    }
}
