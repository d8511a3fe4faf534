<!-- A schema in Prompt Cache's own dialect (its README and implementation): parameters
     with a scaffold, unions with a scaffold member, modules inside a role tag, modules that
     hold only a union, a module that is never cached, and one name ("default") in two
     scopes: age/default and residence/default are different modules with different entries. -->
<schema name="persona">
  <system>
    You are a helpful assistant. Answer briefly, in the voice of the person described below.
    <module name="tone">
      <union scaffold="plain">
        <module name="plain">Speak plainly.</module>
        <module name="cheerful">Speak cheerfully, with enthusiasm.</module>
      </union>
    </module>
  </system>

  <module name="age">
    <union scaffold="default">
      <module name="default">The person's age is not known.</module>
      <module name="child">The person is a child between 6 and 12 years old who goes to primary school.</module>
      <module name="young-adult">The person is between 20 and 34 years old, starting a career and living alone.</module>
      <module name="senior">The person is over 65 years old and retired.</module>
    </union>
  </module>

  <module name="residence">
    <union scaffold="default">
      <module name="default">Where the person lives is not known.</module>
      <module name="city">The person lives in a large city with busy streets and crowded trains.</module>
      <module name="seaside">The person lives by the sea, near beaches and a small harbour.</module>
    </union>
  </module>

  <module name="hobby">
    The person's favourite hobby is <parameter name="activity" length="8" scaffold="something to be named"/>.
  </module>

  <!-- Computed for every request: never stored in (or fetched from) the cache box. -->
  <module name="today" cache="false">
    Today is <parameter name="date" length="8" scaffold="an ordinary day"/>.
  </module>
</schema>
